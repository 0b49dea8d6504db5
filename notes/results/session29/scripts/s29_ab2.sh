#!/usr/bin/env bash
# session 29 A/B 2: HEAD, hand-over, conv signal only (old relu_mask), relaxed signal (unsafe, timing only)
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
[ -d /tmp/site/cutlass_library ] || (cd .gpu2 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3)
export PYTHONUNBUFFERED=1
T0=$(date +%s)
for r in 1 2; do for t in .gpu .gpu2 .gpu3 .gpu4; do
  echo "### tree $t ($(cat $t/HEAD_ID)) round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm timeout 120 python3 tools/probes/cfg_probe.py --batch cases_s29b.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
  echo "t=$(( $(date +%s) - T0 ))"
done; done > $OUTD/ab.log 2>&1
python3 .gpu2/abparse.py $OUTD/ab.log > $OUTD/table.txt 2>&1; cat $OUTD/table.txt; grep "^t=" $OUTD/ab.log | tail -1
