#!/usr/bin/env bash
# One GPU run per milestone: install the carried wheels, run the GPU tests and the benchmarks.
#   tools/gpu_check.sh [pytest args...]        (env: BENCH="bench_conv bench_epilogues ..." to run benchmarks)
# Carry .whl (nvidia-cutlass wheel from ../shared/device/fetch-wheels.sh) and, optionally, .cache
# (a kernel cache precompiled on the dev machine: IGEMM_CACHE_DIR=.cache/igemm).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 3; }
export PYTHONPATH=/tmp/site:$PWD
# optional wheels (e.g. a newer cuda-pathfinder for nvmath-python) only where the machine's own fail
if [ -d .whl-extra ] && ! python3 -c "import nvmath.bindings.cublas" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-extra/*.whl
  echo "installed .whl-extra: $(ls .whl-extra)"
fi
export IGEMM_CACHE_DIR=${IGEMM_CACHE_DIR:-$PWD/.cache/igemm}
mkdir -p "$IGEMM_CACHE_DIR"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, cuda.core, numpy; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version(), 'cuda.core', cuda.core.__version__, 'numpy', numpy.__version__)" | tee -a "$OUT/device.txt"
python3 -c "from igemm import _build; print('compiler:', _build.find_toolchain().describe())" | tee -a "$OUT/device.txt"
if [ -n "${PRECOMPILE:-}" ]; then
  python3 -m igemm precompile $PRECOMPILE 2>&1 | tail -3
fi
rc=0
if [ "$#" -gt 0 ]; then
  python3 -m pytest "$@" 2>&1 | tee "$OUT/pytest.log" | grep -vE '^(tests/.*(PASSED|SKIPPED))' | tail -60
  rc=${PIPESTATUS[0]}
fi
for b in ${BENCH:-}; do
  python3 "benchmarks/$b.py" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$b.log" | tail -40
done
exit $rc
