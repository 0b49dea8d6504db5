#!/usr/bin/env bash
# session 28 run 1: the NCHW residual staged at the persistent kernel's tile start (any V) -- A/B and tests
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu2 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
for r in 1 2; do for t in .gpu .gpu2; do
  echo "### tree $t round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm python3 tools/probes/cfg_probe.py --batch cases_v1.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
done; done 2>&1 | tee $OUTD/ab.log
cd .gpu2; export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm
python3 tools/kernel_breakdown.py --configs fp16-NCHW --layers 5 --chains a,b,c 2>&1 | tail -12 | tee $OUTD/breakdown.log
timeout 300 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "persistent_kernel or several_ctas or cluster_ksplit" -q -n 14 -rfEs --tb=short -p no:benchmark 2>&1 | tail -15 | tee $OUTD/pytest_ws.log
