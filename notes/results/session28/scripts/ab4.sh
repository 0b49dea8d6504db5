#!/usr/bin/env bash
# session 28 run 4: per-tile 128-row tiles capped at 128 registers where two CTAs fit (min_blocks 2) -- A/B
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu5 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
for r in 1 2; do for t in .gpu3 .gpu5; do
  echo "### tree $t ($(cat $t/HEAD_ID)) round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm python3 tools/probes/cfg_probe.py --batch cases_v3.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
done; done 2>&1 | tee $OUTD/ab.log
