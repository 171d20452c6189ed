#!/usr/bin/env bash
# Checkpoint cost, trainloop against Python torch.save, alternated, then the throughput cost of
# checkpointing every N steps:
#
#   benchmarks/run_checkpoint_io.sh [build-dir] [repetitions] [dir]
#
# Needs Debian's python3-torch (scripts/install-deps.sh --benchmarks), the same libtorch 1.13.
set -euo pipefail
build=${1:-build}
reps=${2:-3}
dir=${3:-${TMPDIR:-/tmp}}
for model in cnn mlp100; do
  for rep in $(seq 1 "$reps"); do
    "$build/benchmarks/checkpoint_io" --measure write --model "$model" --repetitions 1 --dir "$dir" | grep RESULT
    /usr/bin/python3 "$(dirname "$0")/checkpoint_pytorch.py" --model "$model" --repetitions 1 --dir "$dir" | grep RESULT
  done
done
for every in 20 100; do
  "$build/benchmarks/checkpoint_io" --measure cost --every-steps "$every" --steps 200 --repetitions "$reps" --dir "$dir"
done
