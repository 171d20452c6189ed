#!/usr/bin/env bash
# Alternates trainloop DDP (C++) and PyTorch DDP (Python) on the same work, REPS times each,
# prints every figure and the median of the per-repetition ratios trainloop/pytorch (goal >= 1.1).
#
#   benchmarks/run_ddp_vs_pytorch.sh [build-dir] [reps] [steps]
# e.g. benchmarks/run_ddp_vs_pytorch.sh build-ddpbench 3 100
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build}"
reps="${2:-3}"
steps="${3:-100}"
common=(--ranks 2 --batch-size 64 --steps "$steps" --epochs 2)
ratios=()
for ((rep = 1; rep <= reps; rep++)); do
  out=$("$build/benchmarks/ddp_vs_pytorch" "${common[@]}" 2>/dev/null)
  echo "$out"
  cxx=$(awk '/^RESULT/ {print $4}' <<<"$out")
  out=$(/usr/bin/python3 "$here/ddp_vs_pytorch.py" "${common[@]}" 2>/dev/null)
  echo "$out"
  py=$(awk '/^RESULT/ {print $4}' <<<"$out")
  ratio=$(awk -v a="$cxx" -v b="$py" 'BEGIN {printf "%.3f", a / b}')
  echo "rep $rep: trainloop $cxx samples/s, pytorch $py samples/s, ratio $ratio"
  ratios+=("$ratio")
done
printf '%s\n' "${ratios[@]}" | sort -g | awk '{r[NR] = $1} END {m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
  printf "median ratio trainloop/pytorch over %d repetitions: %.3f (goal >= 1.1)\n", NR, m}'
