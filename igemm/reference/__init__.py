"""float64 numpy references for every igemm kernel (the numpy backend runs on these too).

One module per family: :mod:`.conv` (direct, im2col+GEMM, FFT), :mod:`.mask` (ReLU bitmask),
:mod:`.epilogue` (BN folding and epilogue chains), :mod:`.norm` (Welford, Chan, BN forward/backward),
:mod:`.index` (index_add), :mod:`.prelu`, :mod:`.grad` (conv backward: grad input/weight, BN+ReLU prologue).
"""
from .conv import *  # noqa: F401,F403
from .mask import *  # noqa: F401,F403
from .index import *  # noqa: F401,F403
from .prelu import *  # noqa: F401,F403
from .epilogue import *  # noqa: F401,F403
from .norm import *  # noqa: F401,F403
from .grad import *  # noqa: F401,F403
