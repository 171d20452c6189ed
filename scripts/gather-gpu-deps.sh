#!/usr/bin/env bash
# Gathers, from this Debian machine's packages, the headers and data a GPU machine lacks, into one
# folder that travels with the checkout (the GPU machines have pip torch, CMake, ninja and a
# compiler, but no Debian packages and no network):
#
#   scripts/gather-gpu-deps.sh [DIR]        # default DIR: .gpu-deps (ignored by git)
#
#   DIR/prefix/       range-v3, nlohmann-json and CLI11 headers with their CMake packages (relocatable), zlib's
#                     headers, and the headers of header-only Boost.Test (tests/unit_test.hpp)
#   DIR/gloo/include  Debian's Gloo headers, used only when the torch wheel ships none
#   DIR/data/         Fashion-MNIST (the example's data)
#
# Then scripts/gpu-check.sh DIR runs the GPU checklist there.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$repo/.gpu-deps}
"$repo/scripts/install-deps.sh" > /dev/null
rm -rf "$out"
mkdir -p "$out/prefix/include" "$out/prefix/lib/cmake" "$out/prefix/share/cmake" "$out/gloo/include" "$out/data"

cp -r /usr/include/range /usr/include/meta /usr/include/concepts /usr/include/std "$out/prefix/include/"
cp -r /usr/lib/cmake/range-v3 "$out/prefix/lib/cmake/"
cp -r /usr/include/nlohmann "$out/prefix/include/"
cp -r /usr/share/cmake/nlohmann_json "$out/prefix/share/cmake/"
cp -r /usr/include/CLI "$out/prefix/include/"
cp -r /usr/share/cmake/CLI11 "$out/prefix/share/cmake/"
cp /usr/include/zlib.h /usr/include/zconf.h "$out/prefix/include/"
cp -r /usr/include/gloo "$out/gloo/include/"
cp /usr/share/datasets/fashion-mnist/*.gz "$out/data/"

# Exactly the Boost headers that header-only Boost.Test pulls in (~3 MB of Boost's 160 MB).
probe=$(mktemp -d)
printf '#define BOOST_TEST_MODULE probe\n#include <boost/test/included/unit_test.hpp>\n' > "$probe/probe.cpp"
g++ -std=c++20 -M "$probe/probe.cpp" | tr ' \\' '\n\n' | grep '^/usr/include/boost/' | sort -u |
  while read -r header; do
    mkdir -p "$out/prefix/include/$(dirname "${header#/usr/include/}")"
    cp "$header" "$out/prefix/include/${header#/usr/include/}"
  done
rm -rf "$probe"
du -sh "$out"
