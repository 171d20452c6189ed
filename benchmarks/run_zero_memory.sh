#!/bin/sh
# Peak resident memory per rank for a ~100 M-parameter MLP with Adam on 2 CPU ranks: DDP with
# gradients copied into buckets (PyTorch's default), DDP with gradients as bucket views
# (trainloop's default) and the sharding levels optimizer, gradients and full (ZeRO-1, -2, -3). One program run per configuration (fresh ranks, nothing
# passed from earlier fits), configurations interleaved and rotated per repetition.
#
#   benchmarks/run_zero_memory.sh <build-dir> [repetitions]
set -eu
# glibc raises its mmap threshold after each freed mmapped block (up to 32 MiB) and then keeps
# freed blocks of that size in its heap: full sharding frees and re-gathers a 64 MiB unit per
# operator and its resident set then grew step by step (full: 2,735 MiB peak vs 1,363 with the
# threshold fixed). A fixed threshold returns every freed block >= 1 MiB to the system, for every
# configuration alike, so the peaks compare what each level holds, not the heap's history.
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
build=${1:?usage: run_zero_memory.sh <build-dir> [repetitions]}
repetitions=${2:-3}
configs="ddp-copies ddp optimizer gradients full"
rep=1
while [ "$rep" -le "$repetitions" ]; do
  for config in $configs; do
    "$build/benchmarks/zero_memory" --repetitions 1 --config "$config" | sed "s/^rep 1/rep $rep/"
  done
  configs="$(echo "$configs" | awk '{print $2, $3, $4, $5, $1}')"  # rotate the order
  rep=$((rep + 1))
done
