#!/bin/sh
# Instructions per DDP step and per fit() on each rank, counted by callgrind (the machine's load
# does not change them, unlike time on this shared machine). See benchmarks/ddp_step_instructions.cpp.
#
#   benchmarks/run_ddp_step_instructions.sh <ddp_step_instructions binary> [out-dir] [ranks] [short long]
#
# Starts the ranks itself, as torchrun would (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each
# under valgrind with one OpenMP thread (libgomp's spinning threads would be counted otherwise).
# Prints, per rank, two counts for a fit of `short` steps and one of `long` steps, and from them the
# cost of a step ((long - short) / (long - short steps)) and of a fit apart from its steps:
#   - "loop": TrainLoop::fit inclusive, on the rank's own thread: what the loop, the engine and
#     libtorch's autograd do for it. Repeatable to ~0.1% (the thread waits in futexes, not loops);
#   - "all": every thread of the process, Gloo's and the reducer's communication thread included.
#     Varies ~10% from run to run: Gloo's threads poll their sockets as often as timing makes them.
set -eu
program=${1:?usage: run_ddp_step_instructions.sh <binary> [out-dir] [ranks] [short-steps long-steps]}
out=${2:-ddp_step_instructions.out}
ranks=${3:-2}
short=${4:-4}
long=${5:-20}
mkdir -p "$out"
port=$((20000 + $$ % 20000))
pids=""
rank=0
while [ "$rank" -lt "$ranks" ]; do
  RANK=$rank WORLD_SIZE=$ranks LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$ranks MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
  OMP_NUM_THREADS=1 valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$out/cg.rank$rank" \
    "$program" --short-steps "$short" --long-steps "$long" >"$out/rank$rank.log" 2>&1 &
  pids="$pids $!"
  rank=$((rank + 1))
done
status=0
for pid in $pids; do wait "$pid" || status=1; done
if [ "$status" -ne 0 ]; then
  echo "a rank failed; see $out/rank*.log" >&2
  tail -n 20 "$out"/rank*.log >&2
  exit 1
fi
# callgrind names each dump <file>.<n> in the order of CALLGRIND_DUMP_STATS_AT: 1 short, 2 long.
# With --instr-atstart=no a dump's summary: line reads 0; its totals: line holds the count.
all() { sed -n 's/^totals: *\([0-9]*\).*/\1/p' "$1" | tail -n 1; }
loop() { callgrind_annotate --inclusive=yes "$1" | grep -m 1 'TrainLoop<.*>::fit(trainloop::FitLength' | awk '{gsub(",", "", $1); print $1}'; }
rank=0
while [ "$rank" -lt "$ranks" ]; do
  for what in loop all; do
    s=$($what "$out/cg.rank$rank.1")
    l=$($what "$out/cg.rank$rank.2")
    awk -v r="$rank" -v w="$what" -v s="$s" -v l="$l" -v a="$short" -v b="$long" 'BEGIN {
      step = (l - s) / (b - a); fit = s - a * step;
      printf "rank %d %-4s: fit of %d steps %.3f M, of %d steps %.3f M; per step %.4f M, per fit apart from steps %.3f M\n",
             r, w, a, s / 1e6, b, l / 1e6, step / 1e6, fit / 1e6 }'
  done
  rank=$((rank + 1))
done
grep -h RESULT "$out"/rank0.log || true
