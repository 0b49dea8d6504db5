#!/usr/bin/env bash
# session 28 run 6 (H200): NHWC 3x3 512 @7 configs for (c); then the benchmarks on HEAD
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
python3 tools/probes/cfg_probe.py --batch cases_v4.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-200 | tee $OUTD/probe.log
OUT=$OUTD bash bench.sh > $OUTD/bench_all.log 2>&1
grep -E "geomean|worst|relu_backward|epi_check|failed|PASS|FAIL" $OUTD/bench_all.log | head -30
