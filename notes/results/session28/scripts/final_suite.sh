#!/usr/bin/env bash
# the whole GPU suite on the snapshot (kernels of the tests precompiled here first, 16 CPUs)
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -4 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
echo "tree $(cat HEAD_ID)" | tee -a $OUTD/device.txt
t0=$(date +%s)
python3 tools/precompile_tests.py sm_90a 2>&1 | tail -2
python3 -m igemm compare --precompile --arch sm_90a 2>&1 | tail -2
python3 tests/test_fuzz.py precompile sm_90a 2>&1 | tail -2
echo "precompile $(( $(date +%s) - t0 )) s"
timeout 420 python3 -m pytest tests -m "gpu and not slow and not multigpu" -q -n 14 -rfEs --tb=line -p no:benchmark 2>&1 | tee $OUTD/pytest.log | grep -vE "PASSED" | tail -25
