#!/usr/bin/env bash
# Writes Debian's Fashion-MNIST as an image folder of PNGs, for examples/image_folder:
#
#   scripts/export-fashion-mnist-images.sh OUT_DIR [--size N] [--rgb]
#       # OUT_DIR/train/<n>_<class>/*.png, OUT_DIR/test/...; 28 x 28 gray unless --size / --rgb
#
# Installs missing system packages first (scripts/install-deps.sh), builds the exporter, runs it.
set -euo pipefail
if [[ $# -lt 1 ]]; then
  echo "usage: scripts/export-fashion-mnist-images.sh OUT_DIR [--size N] [--rgb]" >&2
  exit 2
fi
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$repo/build}
"$repo/scripts/install-deps.sh"
cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build "$build_dir" --target export_fashion_mnist -j "$(nproc)"
"$build_dir/examples/export_fashion_mnist" "$@"
