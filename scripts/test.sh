#!/usr/bin/env bash
# Builds trainloop and runs its whole test suite: the command the README and CI use.
#
#   scripts/test.sh                  # Release build in build/, then ctest
#   BUILD_DIR=build-x scripts/test.sh
#   scripts/test.sh -R test_data     # extra arguments go to ctest
#
# Installs missing system packages first (scripts/install-deps.sh). Exits with ctest's status.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${BUILD_DIR:-$repo/build}
jobs=$(nproc)

"$repo/scripts/install-deps.sh"

cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DTRAINLOOP_WARNINGS_AS_ERRORS=ON
cmake --build "$build_dir" -j "$jobs"

cd "$build_dir"
status=0
ctest --output-on-failure "$@" || status=$?
exit "$status"
