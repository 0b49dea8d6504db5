"""Comparison baselines, apart from the library: explicit im2col + GEMM (cuBLAS), FFT (cuFFT), direct
convolution and cuDNN, timed beside igemm's implicit GEMM (``python -m igemm compare``). The library core never
imports this package; it needs the ``[baselines]`` extra (nvmath-python, tqdm) and torch on a GPU."""
