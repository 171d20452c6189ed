#!/usr/bin/env bash
# Builds and runs the Fashion-MNIST example (examples/fashion_mnist.cpp).
#
#   scripts/train-example.sh                      # trains the Fashion-MNIST CNN with its defaults
#   scripts/train-example.sh --help               # the example's options
#   scripts/train-example.sh --gpu-mode ddp       # any other arguments go to the example
#   scripts/train-example.sh --libtorch debian    # Debian's libtorch 1.13 instead of pip torch 2.11
#   BUILD_DIR=build-x scripts/train-example.sh
#
# Installs what is missing first (scripts/install-deps.sh: Debian's packages, and pip torch 2.11
# in ~/.cache/trainloop). Builds in build/ (pip) or build-debian/ (Debian).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/libtorch-env.sh
source "$repo/scripts/libtorch-env.sh"
libtorch=
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --libtorch) libtorch=${2:-}; shift ;;
    --libtorch=*) libtorch=${1#--libtorch=} ;;
    *) args+=("$1") ;;
  esac
  shift
done
[[ -n $libtorch ]] || libtorch=$(trainloop_default_libtorch)
"$repo/scripts/install-deps.sh" --libtorch "$libtorch"
trainloop_libtorch "$libtorch"
if [[ $libtorch == pip ]]; then default_build=$repo/build; else default_build=$repo/build-debian; fi
build_dir=${BUILD_DIR:-$default_build}

echo "train-example.sh: $libtorch_describe, build in $build_dir"
cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release "${libtorch_cmake_args[@]}"
cmake --build "$build_dir" --target fashion_mnist -j "$(nproc)"

exec "$build_dir/examples/fashion_mnist" "${args[@]}"
