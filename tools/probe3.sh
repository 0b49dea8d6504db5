#!/usr/bin/env bash
set -uo pipefail
cd "$(dirname "$0")/.."
export IGEMM_CACHE_DIR=$PWD/.cache/igemm
OUT=$OUT/s tools/gpu_check.sh > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
for v in "" IGEMM_PATCH_NO_NAMED IGEMM_PATCH_NO_TMA IGEMM_PATCH_NO_WGMMA "IGEMM_PATCH_NO_TMA IGEMM_PATCH_NO_WGMMA"; do
  timeout 60 python3 tools/patch_debug.py $v 2>&1 | tail -2
done
timeout 120 compute-sanitizer --tool memcheck python3 tools/patch_debug.py 2>&1 | grep -v "^=========     Host\|^=========         " | head -30
f=$(ls -t $IGEMM_CACHE_DIR/conv_float16_NHWC_wgmma_*patchvec*.cubin | head -1); echo $f
cuobjdump -sass $f > $OUT/sass.txt 2>&1; grep -nE "UTMA|SYNCS|BAR|WARPGROUP|HGMMA|FENCE|WARPSYNC|ERRBAR|BPT|EXIT" $OUT/sass.txt | head -50
