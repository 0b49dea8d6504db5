#!/usr/bin/env bash
# session 8: the patch kernel (conv1's width unfold in shared memory) on the GPU: its tests, conv1 timed
# against the copy path (IGEMM_PATCH=0) and cuDNN, its candidates, and an ncu look at it
set -uo pipefail
cd "$(dirname "$0")/.."
export IGEMM_CACHE_DIR=$PWD/.cache/igemm
OUT=$OUT/s tools/gpu_check.sh tests/test_conv.py -q -n 8 -k "patch or unfold or graph" -p no:cacheprovider -rfE --tb=short
export PYTHONPATH=/tmp/site:$PWD
B="python3 benchmarks/bench_conv.py --quick --layers 0"
$B --configs fp16-NHWC,bf16-NHWC --out $OUT/b32 2>&1 | grep -E "^\| fp|^\| bf|geomean"
IGEMM_PATCH=0 $B --configs fp16-NHWC --out $OUT/b32c 2>&1 | grep -E "^\| fp|geomean"
for b in 8 1; do $B --batch $b --configs fp16-NHWC --out $OUT/b$b 2>&1 | grep -E "^\| fp"; done
python3 benchmarks/bench_epilogues.py --quick --configs fp16-NHWC --layers 0 --out $OUT/e32 2>&1 | grep -E "^\| fp|geomean|worst"
timeout 150 python3 tools/sweep.py --configs fp16-NHWC --layers 0 --out $OUT/sweep 2>&1 | tail -9
timeout 120 ncu -k regex:igemm_conv --launch-skip 2 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
  --section Occupancy --section WarpStateStats --section LaunchStats python3 tools/profile_layer.py 0 > $OUT/ncu_patch.txt 2>&1
grep -E "Duration|Throughput|Achieved Occ|Theoretical Occ|Block Limit|Registers Per|Shared Memory Per|Hit Rate|Stall|Warp Cycles" $OUT/ncu_patch.txt | head -40
