#!/bin/sh
# Peak resident memory per rank for a ~100 M-parameter MLP with Adam on 2 CPU ranks: DDP with
# gradients copied into buckets (PyTorch's default), DDP with gradients as bucket views
# (trainloop's default) and ZeRO-1. One program run per configuration (fresh ranks, nothing
# passed from earlier fits), configurations interleaved and rotated per repetition.
#
#   benchmarks/run_zero_memory.sh <build-dir> [repetitions]
set -eu
build=${1:?usage: run_zero_memory.sh <build-dir> [repetitions]}
repetitions=${2:-3}
configs="ddp-copies ddp zero"
rep=1
while [ "$rep" -le "$repetitions" ]; do
  for config in $configs; do
    "$build/benchmarks/zero_memory" --repetitions 1 --config "$config" | sed "s/^rep 1/rep $rep/"
  done
  configs="$(echo "$configs" | awk '{print $2, $3, $1}')"  # rotate the order
  rep=$((rep + 1))
done
