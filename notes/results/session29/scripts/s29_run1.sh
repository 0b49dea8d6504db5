#!/usr/bin/env bash
# session 29 run 1: the NCHW mask handed over tile by tile (.gpu2): tests, epi_check
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu2 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
T0=$(date +%s)
(cd .gpu2 && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm timeout 60 python3 tools/probes/epi_check.py --configs fp16-NCHW --layers 4,5,6 2>&1 | tail -12) | tee $OUTD/epi_check.log
(cd .gpu2 && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm timeout 300 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "mask_sync_handover or unfused_mask_after or register_epilogue_nchw_bitwise or nchw_transpose_path_in_graph" -q -n 14 -rfEs --tb=short -p no:benchmark 2>&1 | tail -40) > $OUTD/pytest.log 2>&1
echo "pytest $(( $(date +%s) - T0 )) s"; tail -40 $OUTD/pytest.log
