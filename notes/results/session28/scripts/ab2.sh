#!/usr/bin/env bash
# session 28 run 2: NCHW residual prefetch over every image plane + all V=1 loads at once (BM >= 128) -- A/B, tests
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu3 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
for r in 1 2; do for t in .gpu .gpu3 .gpu4; do
  echo "### tree $t ($(cat $t/HEAD_ID)) round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm python3 tools/probes/cfg_probe.py --batch cases_v2.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
done; done 2>&1 | tee $OUTD/ab.log
cd .gpu3; export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm
timeout 240 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "persistent_nchw_residual_staged or persistent_kernel" -q -n 14 -rfEs --tb=short -p no:benchmark 2>&1 | tail -15 | tee $OUTD/pytest_ws.log
