#!/usr/bin/env bash
# session 28, after the review commit: the NCHW residual tests (V = 1, 2, 4; persistent and per-tile) and the benchmarks
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
echo "tree $(cat HEAD_ID)"
timeout 330 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "persistent_nchw_residual_staged or register_epilogue_nchw or persistent_kernel" -q -n 14 -rfEs --tb=short -p no:benchmark 2>&1 | tee $OUTD/pytest.log | tail -6
OUT=$OUTD bash bench.sh > $OUTD/bench_all.log 2>&1
grep -E "geomean|worst|relu_backward /|failed|PASS|FAIL" $OUTD/bench_all.log | head -14
grep "fp16-" $OUTD/bench_epilogues.md | cut -d'|' -f2-7
