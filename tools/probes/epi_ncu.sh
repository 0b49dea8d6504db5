#!/usr/bin/env bash
# ncu of the epilogue chains (a) conv, (b) +BN+ReLU(mask), (c) +BN+Add+ReLU(mask) on the layers whose
# (b)/(a) or (c)/(a) miss issue #3's bar:  tools/probes/epi_ncu.sh > ncu_epi.txt   (after gpu_check.sh)
set -uo pipefail
cd "$(dirname "$0")/../.."
run() {   # layer layout chain...
  local idx=$1 layout=$2; shift 2
  for ch in "$@"; do
    CHAIN=$ch LAYOUT=$layout timeout 120 tools/probes/ncu_layer.sh "$idx" 32 ''
  done
}
run 3 NHWC none bn_relu_mask bn_add_relu_mask
run 2 NHWC none bn_relu_mask bn_add_relu_mask
run 2 NCHW none bn_relu_mask
run 1 NHWC none bn_add_relu_mask
