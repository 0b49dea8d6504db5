#!/usr/bin/env bash
# session 28 run 8: the V = 1 staging loop with a stepped pointer (.gpu7) against HEAD (.gpu6); SASS sizes
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu7 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
for r in 1 2; do for t in .gpu6 .gpu7; do
  echo "### tree $t ($(cat $t/HEAD_ID)) round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm python3 tools/probes/cfg_probe.py --batch cases_v5.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
done; done > $OUTD/ab.log 2>&1
python3 .gpu5/abparse.py $OUTD/ab.log 2>/dev/null || python3 .gpu7/abparse.py $OUTD/ab.log
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump | head -1)
for t in .gpu6 .gpu7; do
  python3 $t/tools/probes/cubin_elf.py $t/.cache/igemm /tmp/elf$t ws_64x128x64_w1x1_s6_tmatma_regsnchw1 >/dev/null
  for f in /tmp/elf$t/*.cubin; do s=$($CUOBJ -sass $f); echo "$t $(basename $f | cut -c1-90) lines $(echo "$s" | wc -l) LDG.U16 $(echo "$s" | grep -c 'LDG.E.U16') STS.U16 $(echo "$s" | grep -c 'STS.U16')"; done
done | tee $OUTD/sass_sizes.txt
