#!/usr/bin/env bash
# torch.export programs trained by trainloop (interop::ExportedProgram, node by node through the
# dispatcher) against Python eager training the same timm model with the same loop: exports each
# model with examples/export_timm_model.py, then alternates benchmarks/zoo_vs_pytorch --exported
# and benchmarks/zoo_vs_pytorch.py --timm, REPS times each; prints every figure, then per model the
# median and range of each side's samples/s and the median of the per-repetition ratios.
#
#   benchmarks/run_exported_vs_eager.sh [build-dir] [reps] [size] [batch] [steps] [mode] [models]
# e.g. benchmarks/run_exported_vs_eager.sh build 3 64 32 10 single "resnet18 convnext_atto"
#
# Python: $TRAINLOOP_PYTHON, else the venv of pip torch 2.11 (scripts/install-deps.sh puts timm
# there): the same libtorch as the C++ side's pip build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
build="${1:-$here/../build}"
reps="${2:-3}"
size="${3:-64}"
batch="${4:-32}"
steps="${5:-10}"
mode="${6:-single}"
models="${7:-resnet18 efficientnet_b0 convnext_atto vit_tiny_patch16_224}"
python="${TRAINLOOP_PYTHON:-${XDG_CACHE_HOME:-$HOME/.cache}/trainloop/torch-2.15.0/bin/python}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
summary=()
stats() { printf '%s\n' "$@" | sort -g | awk '{r[NR] = $1} END {m = NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2;
  printf "%.1f [%.1f-%.1f]", m, r[1], r[NR]}'; }
for model in $models; do
  "$python" "$here/../examples/export_timm_model.py" "$model" --classes 10 --size "$size" --out "$work/$model.pt2" 2>/dev/null
  common=(--size "$size" --batch-size "$batch" --steps "$steps" --epochs 2 --mode "$mode")
  cxx_all=() py_all=() ratios=()
  for ((rep = 1; rep <= reps; rep++)); do
    cxx=$("$build/benchmarks/zoo_vs_pytorch" --exported "$work/$model.pt2" "${common[@]}" 2>/dev/null | awk '/^RESULT/ {print $4}')
    py=$("$python" "$here/zoo_vs_pytorch.py" --timm "$model" "${common[@]}" 2>/dev/null | awk '/^RESULT/ {print $4}')
    ratio=$(awk -v a="$cxx" -v b="$py" 'BEGIN {printf "%.3f", a / b}')
    echo "$model $mode rep $rep: trainloop (exported) $cxx images/s, python eager $py images/s, ratio $ratio"
    cxx_all+=("$cxx"); py_all+=("$py"); ratios+=("$ratio")
  done
  ratio_median=$(printf '%s\n' "${ratios[@]}" | sort -g | awk '{r[NR] = $1} END {printf "%.3f", NR % 2 ? r[(NR + 1) / 2] : (r[NR / 2] + r[NR / 2 + 1]) / 2}')
  summary+=("| $model | $mode | $(stats "${cxx_all[@]}") | $(stats "${py_all[@]}") | $ratio_median [$(printf '%s\n' "${ratios[@]}" | sort -g | head -1)-$(printf '%s\n' "${ratios[@]}" | sort -g | tail -1)] |")
done
echo
echo "fp32, contiguous, size $size, batch $batch (per rank in ddp), $steps steps per epoch, $reps repetitions alternated; images/s median [min-max]"
echo "| model | mode | trainloop, exported program | Python eager (timm) | ratio (median [min-max]) |"
echo "|---|---|---|---|---|"
printf '%s\n' "${summary[@]}"
