#!/bin/bash
# Two builds of benchmarks/elastic_recovery side by side, interleaved (issue 52): a baseline (e.g. the
# program built at an earlier commit, copied aside with `cp -L build/benchmarks/elastic_recovery /tmp/base`)
# against this build's. Each repetition runs, in this order: the baseline's and this build's `elastic`
# (a rank lost, the survivors go on) and `join` (the same with a replacement; the first two repetitions)
# scenarios, then this build's `restart` (elastic off, max_restarts 1) for comparison. Prints each job's
# result line and rank 0's log lines about the loss and the admission.
#
#   benchmarks/compare_elastic_recovery.sh <baseline program> <program> [repetitions] [elastic_recovery options]
#   e.g. benchmarks/compare_elastic_recovery.sh /tmp/base build/benchmarks/elastic_recovery 3
set -u
baseline=${1:?usage: compare_elastic_recovery.sh <baseline program> <program> [repetitions] [options]}
program=${2:?usage: compare_elastic_recovery.sh <baseline program> <program> [repetitions] [options]}
repetitions=${3:-3}
shift 3 2>/dev/null || shift $#
work=${ER_WORK:-/tmp/trainloop_compare_elastic_recovery.$$}
mkdir -p "$work"
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(lscpu | sed -n 's/^Model name: *//p') $(nproc) cores; options: $*"
for rep in $(seq 1 "$repetitions"); do
  for which in baseline this; do
    prog=$baseline
    [ "$which" = this ] && prog=$program
    for scenario in elastic join; do
      [ "$scenario" = join ] && [ "$rep" -gt 2 ] && continue
      # shellcheck disable=SC2086
      out=$("$prog" --scenario "$scenario" --dir "$work/job" "$@" 2>"$work/stderr.txt" | grep '^elastic_recovery ')
      echo "rep $rep $which: ${out:-no result}"
      grep -h "continuing with\|joined at" "$work/stderr.txt" | sed "s/^/  rep $rep $which: /"
    done
  done
  # shellcheck disable=SC2086
  out=$("$program" --scenario restart --dir "$work/job" "$@" 2>"$work/stderr.txt" | grep '^elastic_recovery ')
  echo "rep $rep restart: ${out:-no result}"
done
rm -rf "$work"
