#!/usr/bin/env bash
# Builds trainloop and runs its test suite: the command the README and CI use.
#
#   scripts/test.sh                      # pip torch 2.11 (CUDA + NCCL compiled, run on the CPU): every
#                                        # test; then Debian's libtorch 1.13: build + -L unit + -L python
#   scripts/test.sh --libtorch pip       # only pip torch 2.11, every test
#   scripts/test.sh --libtorch debian    # only Debian's 1.13, every test
#   scripts/test.sh -R test_data         # other arguments go to ctest (of every libtorch run)
#   TRAINLOOP_DEBIAN_TESTS=all scripts/test.sh   # the whole suite on 1.13 too
#
# Builds in build/ (pip) and build-debian/ (Debian); BUILD_DIR overrides the first. Installs what
# is missing first (scripts/install-deps.sh). Prints each run's ctest summary, then one line
# "N passed, N failed, N skipped" over all runs; exits non-zero if any test failed.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/libtorch-env.sh
source "$repo/scripts/libtorch-env.sh"
runs=(pip debian)
[[ $(trainloop_default_libtorch) == pip ]] || runs=(debian)
ctest_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --libtorch) runs=("${2:-}"); shift ;;
    --libtorch=*) runs=("${1#--libtorch=}") ;;
    *) ctest_args+=("$1") ;;
  esac
  shift
done
combined=$([[ ${#runs[@]} -gt 1 ]] && echo 1 || echo 0)
install_choice=$([[ $combined == 1 ]] && echo both || echo "${runs[0]}")
"$repo/scripts/install-deps.sh" --libtorch "$install_choice"
jobs=$(nproc)

passed=0 failed=0 skipped=0 status=0
summaries=()
run_suite() {  # $1: pip|debian; the rest: ctest's selection
  local libtorch=$1
  shift
  local build_dir
  if [[ $libtorch == pip ]]; then build_dir=${BUILD_DIR:-$repo/build}; else build_dir=$repo/build-debian; fi
  rm -f "$build_dir/ctest-summary.log"
  (
    trainloop_libtorch "$libtorch"
    echo "test.sh: $libtorch_describe, build in $build_dir"
    local started=$SECONDS
    # The headers changed by recent commits are each compiled on their own too (the primary build
    # only; TRAINLOOP_HEADER_CHECK=ALL for every header, OFF for none).
    local header_check=OFF
    [[ $libtorch == pip ]] && header_check=${TRAINLOOP_HEADER_CHECK:-CHANGED}
    cmake -S "$repo" -B "$build_dir" -DCMAKE_BUILD_TYPE=Release -DTRAINLOOP_WARNINGS_AS_ERRORS=ON \
      -DTRAINLOOP_HEADER_CHECK="$header_check" "${libtorch_cmake_args[@]}"
    local targets=()
    if [[ $# -gt 0 ]]; then
      # A selection of tests (-L ...): build only their programs (and what they depend on).
      # Entries are <program>/<case> (or <program> until it is built): the programs to build.
      mapfile -t targets < <(cd "$build_dir" && ctest -N "$@" | awk '/Test +#[0-9]+:/ {print $3}' | sed 's|/.*||' |
        sort -u | grep -Fxf <(cmake --build . --target help | awk '/^\.\.\. / {print $2}') || true)
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
  summaries+=("$libtorch: $((total - fail - skip)) passed, $fail failed, $skip skipped")
}

for libtorch in "${runs[@]}"; do
  if [[ $libtorch == debian && $combined == 1 && ${TRAINLOOP_DEBIAN_TESTS:-} != all ]]; then
    run_suite debian -L "unit|python"  # the CI time budget: 1.13's build, unit and Python-interop tests
  else
    run_suite "$libtorch"
  fi
done
for line in "${summaries[@]}"; do echo "test.sh: $line"; done
echo "$passed passed, $failed failed, $skipped skipped"
exit "$status"
