"""Convolution algorithms compared: implicit GEMM (igemm) vs explicit im2col + GEMM (cuBLAS via nvmath-python)
vs FFT (cuFFT via nvmath-python) vs direct vs cuDNN (torch): time, TFLOP/s, extra device memory, error.

The same code as ``python -m igemm compare`` (igemm/compare.py); same options:

    python benchmarks/compare_algorithms.py --out DIR [--quick] [--dtype float16] [--layout NHWC]
        [--layers resnet50,sweep] [--match SUBSTR] [--algorithms implicit,im2col,fft,direct,cudnn] [--mem-cap 16]

Writes DIR/compare_<backend>_<dtype>_<layout>.{md,json,png}. Without a GPU it runs the numpy
implementations on small sizes and says so.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # a source checkout without install

from igemm.baselines.compare import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
