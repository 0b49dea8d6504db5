#!/usr/bin/env bash
# the benchmarks with their peers, epi_check, sanitizer (after final_suite.sh on the same machine, or alone)
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
[ -d /tmp/site/cutlass_library ] || OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -4 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
echo "tree $(cat HEAD_ID)"
python3 benchmarks/bench_epilogues.py --quick --out $OUTD 2>&1 | tee $OUTD/bench_epilogues.log | tail -45
python3 benchmarks/bench_conv.py --quick --configs fp16-NHWC,fp16-NCHW --out $OUTD 2>&1 | tee $OUTD/bench_conv.log | tail -30
python3 tools/probes/epi_check.py 2>&1 | tee $OUTD/epi_check.log | tail -3
OUT=/tmp/san tools/sanitize.sh conv 2>&1 | tail -6 | tee $OUTD/sanitize.log
