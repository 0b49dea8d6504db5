#!/usr/bin/env bash
# ncu on one ResNet-50 layer: igemm under several configs and cuDNN (F.conv2d), kernel summaries only.
#   tools/probes/ncu_layer.sh IDX N 'cfg-json' ['cfg-json' ...]      ('' = the chosen config, 'cudnn' = F.conv2d)
#   env: CHAIN=none|bn_relu_mask|bn_add_relu_mask (igemm's epilogue), LAYOUT=NHWC|NCHW, SECTIONS=... (ncu's)
# precompile the configs on the dev machine first: python tools/probes/ncu_layer.py IDX N cfg...
set -uo pipefail
idx=$1; n=$2; shift 2
NCU=${NCU:-$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)}
SECTIONS=${SECTIONS:-"--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats"}
METRICS="--metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,lts__t_bytes.sum,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_sectors_op_write.sum,lts__t_sectors_op_read.sum,lts__t_sector_hit_rate.pct,sm__cycles_active.avg,smsp__warps_launched.sum,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,smsp__inst_executed_op_shared_st.sum,smsp__inst_executed_op_shared_ld.sum,smsp__inst_executed_op_global_st.sum"
for cfg in "$@"; do
  if [ "$cfg" = cudnn ]; then chain=cudnn; c=""; else chain=${CHAIN:-none}; c=$cfg; fi
  echo "=== layer $idx N=$n ${LAYOUT:-NHWC} chain $chain config ${cfg:-chosen}"
  $NCU --launch-skip 2 --launch-count 1 -k 'regex:igemm_conv2d|xmma|cudnn|sm90_|implicit_gemm' $SECTIONS $METRICS \
    python3 tools/profile_layer.py "$idx" "${LAYOUT:-NHWC}" "$chain" "$c" "$n" 2>&1 \
    | grep -vE '^==PROF==|^\s*-{5,}|^\s*$|OPT|Section:|estimated speedup|^\s+(This|The|See|Check|Consider|higher|memory|occupancy|warps|kernel|is|of|by|theoretical|achieved|a |an |to |for |in |on |and |or |as |it |be |with )'
done
