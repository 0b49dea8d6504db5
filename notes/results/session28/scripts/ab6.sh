#!/usr/bin/env bash
# session 28 run 9: stepped pointers in both V = 1 loops (.gpu8) against HEAD (.gpu6); SASS sizes
cd "$(dirname "$0")/.."
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD
(cd .gpu8 && OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3) | tee $OUTD/device.txt
export PYTHONUNBUFFERED=1
for r in 1 2; do for t in .gpu6 .gpu8; do
  echo "### tree $t ($(cat $t/HEAD_ID)) round $r"
  (cd $t && PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm python3 tools/probes/cfg_probe.py --batch cases_v6.json 2>&1 | grep -v "kernels compiled" | sed 's/\[a: .*//' | cut -c1-160)
done; done > $OUTD/ab.log 2>&1
python3 .gpu5/abparse.py $OUTD/ab.log 2>/dev/null || python3 .gpu8/abparse.py $OUTD/ab.log
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump | head -1)
for t in .gpu6 .gpu8; do
  python3 $t/tools/probes/cubin_elf.py $t/.cache/igemm /tmp/elf$t tmatma_regsnchw1 >/dev/null
  for f in /tmp/elf$t/*.cubin; do s=$($CUOBJ -sass $f); echo "$t $(basename $f | cut -c1-90) lines $(echo "$s" | wc -l) LDG.U16 $(echo "$s" | grep -c 'LDG.E.U16') STS.U16 $(echo "$s" | grep -c 'STS.U16')"; done
done | tee $OUTD/sass_sizes.txt
cd .gpu8; export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm
timeout 300 python3 -m pytest tests/test_conv.py -m "gpu and not slow and not multigpu" -k "register_epilogue_nchw or persistent_nchw_residual_staged or persistent_kernel or cluster_ksplit or several_ctas" -q -n 14 -rfEs --tb=short -p no:benchmark 2>&1 | tail -8 | tee $OUTD/pytest.log
