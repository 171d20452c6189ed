#!/usr/bin/env bash
# Builds and runs the Fashion-MNIST example (examples/fashion_mnist.cpp).
#
#   scripts/train-example.sh                      # trains the Fashion-MNIST CNN with its defaults
#   scripts/train-example.sh --help               # the example's options
#   scripts/train-example.sh --gpu-mode ddp       # any other arguments go to the example
#   scripts/train-example.sh --torch 2.12.1       # another supported pip torch than 2.15.0
#   BUILD_DIR=build-x scripts/train-example.sh
#
# Installs what is missing first (scripts/install-deps.sh: Debian's packages, and pip torch 2.15
# in ~/.cache/trainloop). Builds in build/ (2.15) or build-torch-<version>/ (another release).
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/libtorch-env.sh
source "$repo/scripts/libtorch-env.sh"
version=$trainloop_torch_primary
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) version=${2:?--torch needs a version, e.g. --torch 2.12.1}; shift ;;
    --torch=*) version=${1#--torch=} ;;
    *) args+=("$1") ;;
  esac
  shift
done
install_args=()
[[ $version == "$trainloop_torch_primary" ]] || install_args=(--torch "$version")
"$repo/scripts/install-deps.sh" "${install_args[@]}"
trainloop_libtorch "$version"
build_dir=$(trainloop_build_dir_of "$version")
generator=()
command -v ninja > /dev/null && [[ ! -f $build_dir/Makefile ]] && generator=(-G Ninja)

echo "train-example.sh: $libtorch_describe, build in $build_dir"
cmake -S "$repo" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "${libtorch_cmake_args[@]}"
cmake --build "$build_dir" --target fashion_mnist -j "$(nproc)"

exec "$build_dir/examples/fashion_mnist" "${args[@]}"
