#!/usr/bin/env bash
# Builds and runs the Fashion-MNIST example (examples/fashion_mnist.cpp).
#
#   scripts/train-example.sh                  # trains the Fashion-MNIST CNN with its defaults
#   scripts/train-example.sh --help           # the example's options
#   scripts/train-example.sh --gpu-mode ddp   # any arguments go to the example
#   BUILD_DIR=build-x scripts/train-example.sh
#
# Installs missing system packages first (scripts/install-deps.sh).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$repo/build}

"$repo/scripts/install-deps.sh"

cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release
cmake --build "$build_dir" --target fashion_mnist -j "$(nproc)"

exec "$build_dir/examples/fashion_mnist" "$@"
