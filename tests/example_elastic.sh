#!/usr/bin/env bash
# The example from outside (issues 52 and 53), 3 CPU ranks of fashion_mnist:
# 1. a clean run (3 ranks, 2400 images): its test accuracy, and no "straggler:" line;
# 2. --elastic with rank 2 killed by `kill -9` during epoch 2: exit status 0, the lost rank named,
#    the test accuracy within 0.03 of the clean run's (the last steps ran on 2 ranks), no process left;
#    with --gpu-mode ddp, then --gpu-mode fsdp (sharding full: the lost rank's shards from its neighbour's copy);
#    a replacement for rank 2 is started, and no process of it is left either;
# 3. rank 1 stopped 150 ms of every 300 ms (SIGSTOP/SIGCONT): a "straggler:" line names its pid.
#
#   tests/example_elastic.sh <fashion_mnist executable> <scratch dir>
set -euo pipefail
example=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
base=(--procs 3 --train-samples 2400 --batch-size 32 --progress epochs)
args=(--gpu-mode ddp "${base[@]}")

accuracy() { grep -a "test accuracy" "$1" | tail -n 1 | sed -E 's/.*test accuracy ([0-9.]+).*/\1/'; }
ranks_of() { pgrep -P "$1" | sort -n; }  # the launcher's children, spawned in rank order
fail() { echo "FAIL: $1" >&2; cat "$2" >&2; exit 1; }

"$example" "${args[@]}" --epochs 2 > "$work/clean.log" 2>&1 || fail "the clean run failed" "$work/clean.log"
clean=$(accuracy "$work/clean.log")
grep -aq "straggler:" "$work/clean.log" && fail "a clean run named a straggler" "$work/clean.log"

# $1: the log's name; the rest: the mode's flags (ddp, then fsdp: sharded state rebuilt from a neighbour's copy).
kill_rank_2_mid_run() {
  local log=$work/$1.log
  shift
  "$example" "$@" "${base[@]}" --epochs 2 --elastic > "$log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 600); do grep -aq "epoch 1" "$log" && break; sleep 0.1; done
  for _ in $(seq 1 100); do [[ $(ranks_of "$pid" | wc -l) == 3 ]] && break; sleep 0.1; done
  local ranks victim status=0
  ranks=$(ranks_of "$pid")
  victim=$(echo "$ranks" | sed -n 3p)
  [[ -n $victim ]] || fail "no rank 2 to kill" "$log"
  kill -9 "$victim"
  wait "$pid" || status=$?
  [[ $status == 0 ]] || fail "the elastic run ($*) ended with status $status" "$log"
  grep -aq "rank 2 (pid $victim) lost at step" "$log" || fail "the lost rank was not named" "$log"
  local elastic
  elastic=$(accuracy "$log")
  awk -v a="$elastic" -v b="$clean" 'BEGIN { d = a - b; exit (d <= 0.03 && d >= -0.03) ? 0 : 1 }' ||
    fail "test accuracy $elastic after the loss ($*), $clean without" "$log"
  # Its replacement (max_replacements 1 by default) joins when it is up if the fit is not over by then
  # (tests/test_elastic.cpp checks a join exactly); either way it ends with the job.
  local replacement
  replacement=$(grep -a "started a replacement for rank 2" "$log" | sed -E 's/.*\(pid ([0-9]+),.*/\1/')
  [[ -n $replacement ]] || fail "no replacement was started for rank 2" "$log"
  for rank in $ranks $replacement; do kill -0 "$rank" 2> /dev/null && fail "rank pid $rank still running" "$log"; done
  echo "$* after losing rank 2: test accuracy $elastic; $(grep -a 'lost at step' "$log")"
  echo "  $(grep -a 'joined at step' "$log" || echo "its replacement (pid $replacement) was not needed: the fit ended first")"
}
kill_rank_2_mid_run elastic --gpu-mode ddp
kill_rank_2_mid_run elastic_fsdp --gpu-mode fsdp

"$example" "${args[@]}" --epochs 3 > "$work/slow.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do [[ $(ranks_of "$pid" | wc -l) == 3 ]] && break; sleep 0.1; done
slow=$(ranks_of "$pid" | sed -n 2p)
[[ -n $slow ]] || fail "no rank 1 to slow" "$work/slow.log"
while kill -0 "$pid" 2> /dev/null; do
  kill -STOP "$slow" 2> /dev/null || break
  sleep 0.15
  kill -CONT "$slow" 2> /dev/null || break
  sleep 0.15
done
wait "$pid" || fail "the slowed run failed" "$work/slow.log"
grep -aq "straggler: rank 1 (pid $slow," "$work/slow.log" || fail "the slowed rank 1 (pid $slow) was not named" "$work/slow.log"
echo "clean $clean; $(grep -a 'straggler:' "$work/slow.log" | head -1)"
[[ -n ${KEEP_WORK:-} ]] || rm -rf "$work"
