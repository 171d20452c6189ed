#!/usr/bin/env bash
# Alternates trainloop (C++, benchmarks/zoo_vs_pytorch) and Python PyTorch (torchvision's same
# model, benchmarks/zoo_vs_pytorch.py) on the same training work, REPS times each, for every
# (arch, mode) pair; prints every figure, then per pair the median and range of each side's
# samples/s and the median of the per-repetition ratios trainloop/pytorch.
#
#   benchmarks/run_zoo_vs_pytorch.sh [build-dir] [reps] [size] [batch] [steps] [precision] [memory-format] [archs]
# e.g. benchmarks/run_zoo_vs_pytorch.sh build 3 64 32 20
#      benchmarks/run_zoo_vs_pytorch.sh build 3 64 64 10 bf16 channels-last resnet18
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build}"
reps="${2:-3}"
size="${3:-64}"
batch="${4:-32}"
steps="${5:-20}"
precision="${6:-fp32}"
memory_format="${7:-contiguous}"
archs="${8:-resnet18 resnet50}"
summary=()
for arch in $archs; do
  for mode in single ddp; do
    common=(--arch "$arch" --size "$size" --batch-size "$batch" --steps "$steps" --epochs 2 --mode "$mode"
            --precision "$precision" --memory-format "$memory_format")
    cxx_all=() py_all=() ratios=()
    for ((rep = 1; rep <= reps; rep++)); do
      cxx=$("$build/benchmarks/zoo_vs_pytorch" "${common[@]}" 2>/dev/null | awk '/^RESULT/ {print $4}')
      py=$(/usr/bin/python3 "$here/zoo_vs_pytorch.py" "${common[@]}" 2>/dev/null | awk '/^RESULT/ {print $4}')
      ratio=$(awk -v a="$cxx" -v b="$py" 'BEGIN {printf "%.3f", a / b}')
      echo "$arch $mode rep $rep: trainloop $cxx images/s, pytorch $py images/s, ratio $ratio"
      cxx_all+=("$cxx"); py_all+=("$py"); ratios+=("$ratio")
    done
    stats() { printf '%s\n' "$@" | sort -g | awk '{r[NR] = $1} END {m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
      printf "%.1f [%.1f-%.1f]", m, r[1], r[NR]}'; }
    ratio_median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{r[NR] = $1} END {printf "%.3f", NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2}')
    summary+=("| $arch | $mode | $(stats "${cxx_all[@]}") | $(stats "${py_all[@]}") | $ratio_median |")
  done
done
echo
echo "$precision, $memory_format, size $size, batch $batch (per rank in ddp), $steps steps per epoch, $reps repetitions alternated; images/s median [min-max]"
echo "| model | mode | trainloop | PyTorch | ratio (median) |"
echo "|---|---|---|---|---|"
printf '%s\n' "${summary[@]}"
