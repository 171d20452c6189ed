#!/usr/bin/env bash
# Builds trainloop and runs its test suite: the command the README and CI use.
#
#   scripts/test.sh                      # pip torch 2.15 (the primary libtorch; CUDA + NCCL compiled, run
#                                        # on the CPU): every test; then pip torch 2.11 (the oldest
#                                        # supported): build + -L unit + -L python
#   scripts/test.sh --torch 2.15.0       # only that release, every test (any of 2.11.0 ... 2.15.0)
#   scripts/test.sh -R test_data         # other arguments go to ctest (of every run)
#   TRAINLOOP_OLDEST_TESTS=all scripts/test.sh   # the whole suite on 2.11 too
#   TRAINLOOP_EXAMPLES_OPTIMIZATION=-O1 scripts/test.sh   # examples and benchmarks at -O1 (CI's setting)
#
# Builds in build/ (the primary release; BUILD_DIR overrides) and build-torch-<version>/ (others).
# Installs what is missing first (scripts/install-deps.sh). Prints each run's ctest summary, then
# one line "N passed, N failed, N skipped" over all runs; exits non-zero if any test failed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/libtorch-env.sh
source "$repo/scripts/libtorch-env.sh"
runs=("$trainloop_torch_primary" "$trainloop_torch_oldest")
ctest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --torch) runs=("${2:?--torch needs a version, e.g. --torch 2.11.0}"); shift ;;
    --torch=*) runs=("${1#--torch=}") ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
combined=$([[ ${#runs[@]} -gt 1 ]] && echo 1 || echo 0)
install_args=()
for version in "${runs[@]}"; do install_args+=(--torch "$version"); done
"$repo/scripts/install-deps.sh" "${install_args[@]}"
jobs=$(nproc)

passed=0 failed=0 skipped=0 status=0
summaries=()
run_suite() {  # $1: the torch release; the rest: ctest's selection
  local version=$1
  shift
  local build_dir
  build_dir=$(trainloop_build_dir_of "$version")
  rm -f "$build_dir/ctest-summary.log"
  (
    trainloop_libtorch "$version"
    echo "test.sh: $libtorch_describe, build in $build_dir"
    local started=$SECONDS
    # The headers changed by recent commits are each compiled on their own too (the primary build
    # only; TRAINLOOP_HEADER_CHECK=ALL for every header, OFF for none).
    local header_check=OFF
    [[ $version == "$trainloop_torch_primary" ]] && header_check=${TRAINLOOP_HEADER_CHECK:-CHANGED}
    local generator=()  # Ninja for a new build folder (an existing one keeps its generator)
    command -v ninja > /dev/null && [[ ! -f $build_dir/CMakeCache.txt ]] && generator=(-G Ninja)
    # TRAINLOOP_EXAMPLES_OPTIMIZATION (CI: -O1) builds the examples and benchmarks at that level;
    # unset, at the build type's (-O3), as users and the benchmarks' numbers expect.
    cmake -S "$repo" -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DTRAINLOOP_WARNINGS_AS_ERRORS=ON \
      -DTRAINLOOP_HEADER_CHECK="$header_check" -DTRAINLOOP_EXAMPLES_OPTIMIZATION="${TRAINLOOP_EXAMPLES_OPTIMIZATION:-}" \
      "${libtorch_cmake_args[@]}"
    local targets=()
    if [[ $# -gt 0 ]]; then
      # A selection of tests (-L ...): build only their programs (and what they depend on).
      # Entries are <program>/<case> (or <program> until it is built): the programs to build.
      mapfile -t targets < <(cd "$build_dir" && ctest -N "$@" | awk '/Test +#[0-9]+:/ {print $3}' | sed 's|/.*||' |
        sort -u | grep -Fxf <(cmake --build . --target help | sed -nE 's/^\.\.\. ([^ ]+).*/\1/p; s/^([A-Za-z0-9_.+-]+): phony$/\1/p') || true)
    fi
    if [[ ${#targets[@]} -gt 0 ]]; then
      cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}"
    else
      cmake --build "$build_dir" -j "$jobs"
    fi
    echo "test.sh: built with $libtorch_describe in $((SECONDS - started)) s"
    cd "$build_dir"
    # One entry per test case; rank-starting programs hold the lock "ranks" (tests/CMakeLists.txt),
    # so -j runs them one at a time beside the rest. CTEST_PARALLEL_LEVEL overrides the default.
    ctest --output-on-failure -j "${CTEST_PARALLEL_LEVEL:-$jobs}" "$@" "${ctest_args[@]}" 2>&1 |
      tee "$build_dir/ctest-summary.log"
    exit "${PIPESTATUS[0]}"
  ) || status=1
  local log=$build_dir/ctest-summary.log
  [[ -f $log ]] || return 0
  local line total fail skip
  line=$(grep -E "tests passed, [0-9]+ tests failed out of [0-9]+" "$log" | tail -1 || true)
  total=$(sed -E 's/.*out of ([0-9]+).*/\1/' <<< "$line")
  fail=$(sed -E 's/.*passed, ([0-9]+) tests failed.*/\1/' <<< "$line")
  skip=$(grep -cE "\*\*\*Skipped|Not Run \(Disabled\)" "$log" || true)
  [[ -n $total && -n $fail ]] || return 0
  passed=$((passed + total - fail - skip)); failed=$((failed + fail)); skipped=$((skipped + skip))
  summaries+=("torch $version: $((total - fail - skip)) passed, $fail failed, $skip skipped")
}

for version in "${runs[@]}"; do
  if [[ $version == "$trainloop_torch_oldest" && $combined == 1 && ${TRAINLOOP_OLDEST_TESTS:-} != all ]]; then
    run_suite "$version" -L "unit|python"  # CI's time budget: the oldest release's unit and Python-interop tests
  else
    run_suite "$version"
  fi
done
for line in "${summaries[@]}"; do echo "test.sh: $line"; done
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
