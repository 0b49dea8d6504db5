#!/usr/bin/env bash
# session 27's targeted GPU run after the heuristic change: the several-CTAs test, epi_check, the benchmarks, a probe
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -4 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
echo "tree $(cat HEAD_ID)"
timeout 200 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "several_ctas" -q -n 8 -rfEs --tb=short -p no:benchmark 2>&1 | tee $OUTD/pytest_several.log | tail -5
OUT=$OUTD bash bench.sh
python3 tools/probes/cfg_probe.py --batch cases_n128.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-200 | tee $OUTD/probe_n128.log
