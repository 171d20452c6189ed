#!/usr/bin/env bash
# What the libtorch upgrade gives: trainloop built against pip torch 2.11 vs trainloop built
# against Debian's libtorch 1.13 vs Python torch 2.11 (the same settings and loop), on the
# example CNN (Fashion-MNIST, batch 64) and resnet18 (64 px synthetic, batch 64), fp32 contiguous
# and bf16 + channels-last, single process on all cores. Repetitions are interleaved (the order of
# the three rotates each repetition); prints every figure, then per row the median [min-max]
# samples/s of each side and the ratios of the medians.
#
#   benchmarks/run_libtorch_versions.sh [pip-build] [debian-build] [reps] [cnn-samples] [resnet-steps]
#   e.g. benchmarks/run_libtorch_versions.sh build build-debian 3 6400 10
#
# Python: $TRAINLOOP_VENV's (scripts/install-deps.sh). Python runs with the tuned environment of
# run_cnn_vs_pytorch.sh (OMP_NUM_THREADS=<cores>, OPENBLAS_NUM_THREADS=1, glibc keeping freed memory).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
pip_build=${1:-$repo/build}
debian_build=${2:-$repo/build-debian}
reps=${3:-3}
cnn_samples=${4:-6400}
resnet_steps=${5:-10}
source "$repo/scripts/libtorch-env.sh"
python="$trainloop_venv/bin/python"
cores=$(nproc)
keep="glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912"

run_side() {  # side workload precision format -> samples/s
  local side=$1 workload=$2 precision=$3 format=$4 build
  case $side in
    trainloop-2.11) build=$pip_build ;;
    trainloop-1.13) build=$debian_build ;;
  esac
  if [[ $workload == cnn ]]; then
    if [[ $side == python-2.11 ]]; then
      OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=1 GLIBC_TUNABLES=$keep "$python" "$here/cnn_pytorch.py" --mode single \
        --samples "$cnn_samples" --precision "$precision" --memory-format "$format" | awk '/^RESULT/ {print $10}'
    else
      "$build/benchmarks/compare_modes" --workload cnn --samples "$cnn_samples" --repetitions 1 --modes single \
        --precision "$precision" --memory-format "$format" --csv /tmp/run_libtorch_versions.csv |
        awk '$1 == "single" && $2 ~ /^[0-9.]+$/ {print $2; exit}'
    fi
  else
    local args=(--arch resnet18 --size 64 --batch-size 64 --steps "$resnet_steps" --epochs 2 --mode single
                --precision "$precision" --memory-format "$format")
    if [[ $side == python-2.11 ]]; then
      OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=1 GLIBC_TUNABLES=$keep "$python" "$here/zoo_vs_pytorch.py" "${args[@]}" 2>/dev/null |
        awk '/^RESULT/ {print $4}'
    else
      "$build/benchmarks/zoo_vs_pytorch" "${args[@]}" 2>/dev/null | awk '/^RESULT/ {print $4}'
    fi
  fi
}

median_range() { printf '%s\n' "$@" | sort -g | awk '{r[NR] = $1} END {m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
  printf "%.1f [%.1f-%.1f]", m, r[1], r[NR]}'; }
median() { printf '%s\n' "$@" | sort -g | awk '{r[NR] = $1} END {printf "%.1f", NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2}'; }

echo "machine: $(lscpu | awk -F: '/Model name/ {gsub(/^ +/, "", $2); print $2; exit}'), $cores cores; python: $("$python" -c 'import torch; print(torch.__version__)')"
sides=(trainloop-2.11 trainloop-1.13 python-2.11)
table=()
for row in "cnn fp32 contiguous" "cnn bf16 channels-last" "resnet18 fp32 contiguous" "resnet18 bf16 channels-last"; do
  read -r workload precision format <<< "$row"
  declare -A results=()
  for ((rep = 0; rep < reps; rep++)); do
    line="$workload $precision $format rep $((rep + 1)):"
    for ((k = 0; k < ${#sides[@]}; k++)); do
      side=${sides[$(((k + rep) % ${#sides[@]}))]}
      value=$(run_side "$side" "$workload" "$precision" "$format")
      results[$side]+="$value "
      line+=" $side $value"
    done
    echo "$line"
  done
  new=$(median ${results[trainloop-2.11]}); old=$(median ${results[trainloop-1.13]}); py=$(median ${results[python-2.11]})
  table+=("| $workload | $precision $format | $(median_range ${results[trainloop-2.11]}) | $(median_range ${results[trainloop-1.13]}) | $(median_range ${results[python-2.11]}) | $(awk -v a="$new" -v b="$old" 'BEGIN {printf "%.2fx", a / b}') | $(awk -v a="$new" -v b="$py" 'BEGIN {printf "%.2fx", a / b}') |")
  unset results
done
echo
echo "samples/s median [min-max] of $reps interleaved repetitions; CNN $cnn_samples samples, resnet18 64 px $resnet_steps steps, batch 64"
echo "| model | precision | trainloop on 2.11 | trainloop on 1.13 | Python 2.11 | 2.11 / 1.13 | trainloop / Python |"
echo "|---|---|---|---|---|---|---|"
printf '%s\n' "${table[@]}"
