#!/usr/bin/env bash
# session 28 run 3: ncu of NCHW (b) against (c) where (c) costs far more than the residual's bytes; SASS of the kernels
cd "$(dirname "$0")"
OUTD=${OUT:-/tmp/out}; mkdir -p $OUTD/sass
OUT=/tmp/setup tools/gpu_check.sh 2>&1 | tail -3 | tee $OUTD/device.txt
export PYTHONPATH=/tmp/site:$PWD IGEMM_CACHE_DIR=$PWD/.cache/igemm PYTHONUNBUFFERED=1
export SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats"
for spec in "5 128" "4 32"; do set -- $spec
  for ch in bn_relu_mask bn_add_relu_mask; do
    CHAIN=$ch LAYOUT=NCHW timeout 150 tools/probes/ncu_layer.sh $1 $2 ''
  done
done 2>&1 | tee $OUTD/ncu.log | grep -E "===|Duration|Executed Ipc A|Registers Per|Warp Cycles Per Issued|Stall|inst_executed.sum|dram__bytes|lts__t_sector_hit|Issue Slots Busy|No Eligible|Achieved Occ"
python3 tools/probes/cubin_elf.py .cache/igemm /tmp/elf 128x128x64_w2x1_s3_tmatma_regsnchw1 >/dev/null
python3 tools/probes/cubin_elf.py .cache/igemm /tmp/elf 128x128x64_w2x1_s4_tmatma_regsnchw4 >/dev/null
CUOBJ=$(command -v cuobjdump || ls /usr/local/cuda*/bin/cuobjdump | head -1)
for f in /tmp/elf/*.cubin; do $CUOBJ -sass $f > $OUTD/sass/$(basename $f .cubin).sass; done
wc -l $OUTD/sass/*.sass
