#!/usr/bin/env bash
# ImageFolder throughput (decode + augment + batch, no training), trainloop vs torchvision, with 1
# and 2 loader workers, alternated:
#
#   benchmarks/run_image_pipeline.sh [build-dir] [repetitions] [images]
#
# Makes a synthetic folder of 320x240 JPEGs first. Needs python3-torchvision
# (scripts/install-deps.sh --benchmarks).
set -euo pipefail
build=${1:-build}
reps=${2:-3}
images=${3:-2000}
here=$(cd "$(dirname "$0")" && pwd)
folder=$(mktemp -d)
trap 'rm -rf "$folder"' EXIT
"$build/benchmarks/image_pipeline" --make-folder "$folder" --images "$images"
for rep in $(seq 1 "$reps"); do
  for workers in 1 2; do
    "$build/benchmarks/image_pipeline" --data "$folder" --workers "$workers" | grep RESULT
    /usr/bin/python3 "$here/image_pipeline_torchvision.py" --data "$folder" --workers "$workers" | grep RESULT
  done
done
