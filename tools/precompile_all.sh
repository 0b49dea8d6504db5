#!/usr/bin/env bash
# Fill the kernel cache ($IGEMM_CACHE_DIR, default .cache/igemm) with every kernel a GPU run launches, on the
# dev machine (no GPU needed), so the device's time goes to running, not to nvcc. Cache hits cost nothing:
# rerun after any csrc/ change and only the kernels whose sources changed are rebuilt.
#   tools/precompile_all.sh [arch=sm_90a] [sms=132]      env: JOBS (default: all cores)
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:-sm_90a}; SMS=${2:-132}; JOBS=${JOBS:-$(nproc)}
export IGEMM_CACHE_DIR=${IGEMM_CACHE_DIR:-$PWD/.cache/igemm}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step() { local t0=$(date +%s); echo "== $1"; shift; "$@"; echo "   $(( $(date +%s) - t0 )) s"; }
step "conv (bench/test configs) + epilogues + backward" python3 -m igemm precompile --epilogues --backward \
  --configs float16:NHWC:strict,float16:NCHW:strict,float32:NCHW:strict,bfloat16:NHWC:strict --jobs "$JOBS" --arch "$ARCH"
step "index_add + prelu + pool" python3 -c "import importlib,sys;[importlib.import_module(m).precompile('$ARCH',$JOBS) for m in ('igemm.index_add','igemm.prelu','igemm.pool')]"
step "norm" python3 -c "import igemm.norm as n; n.precompile('$ARCH', jobs=$JOBS)"
step "syncbn (2-GPU test)" python3 tests/test_syncbn.py precompile "$ARCH" "$SMS"
step "conv, batch 8 and 1 (bench_conv --batch)" bash -c "python3 -m igemm precompile --batch 8 --configs \
  float16:NHWC:strict,float16:NCHW:strict --arch $ARCH --jobs $JOBS && python3 -m igemm precompile --batch 1 \
  --configs float16:NHWC:strict,float16:NCHW:strict --arch $ARCH --jobs $JOBS"
step "the GPU tests' non-default conv kernels" python3 tools/precompile_tests.py "$ARCH"
step "compare" python3 -m igemm compare --precompile --arch "$ARCH"
step "fuzz" python3 tests/test_fuzz.py precompile "$ARCH"
step "backward tests and fuzz" python3 tests/test_backward.py precompile "$ARCH" 300
step "training tests (igemm.nn)" python3 tests/test_train.py precompile "$ARCH"
step "training in CUDA graphs" python3 tests/test_train_graphs.py precompile "$ARCH"
echo "cache: $(ls "$IGEMM_CACHE_DIR" | grep -c cubin) cubins, $(du -sh "$IGEMM_CACHE_DIR" | cut -f1)"
