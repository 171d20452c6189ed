#!/bin/bash
# Issue 52: what a lost rank costs a DDP job — elastic training (the survivors regroup in place)
# against today's restart (every rank restarted from the newest checkpoint) — and what elastic
# training's step commits cost a step without failures. benchmarks/elastic_recovery.cpp runs one
# job per call (trainloop's launcher spawns the ranks); this script interleaves them.
#
#   benchmarks/run_elastic_recovery.sh <build-dir> [repetitions] [extra elastic_recovery options]
#   e.g. benchmarks/run_elastic_recovery.sh build 3                         (100.7 M parameters)
#        benchmarks/run_elastic_recovery.sh build 3 --layers 2 --width 512  (a small MLP)
#        benchmarks/run_elastic_recovery.sh build 1 --sharding full         (fsdp: the neighbour copies)
#
# Each repetition, in this order: steady with elastic off, steady with elastic on (the step time
# ratio is the commits' cost), a rank killed with elastic on, the same kill with elastic off and
# max_restarts(1) (a checkpoint every --every steps), then the kill with elastic on and a replacement
# (max_replacements 1) that joins. The table: medians over the repetitions, with min-max.
set -u
build=${1:?usage: run_elastic_recovery.sh <build-dir> [repetitions] [options]}
repetitions=${2:-3}
shift 2 2>/dev/null || shift $#
program=$(cd "$build" && pwd)/benchmarks/elastic_recovery
[ -x "$program" ] || { echo "no $program: build the trainloop_benchmarks target"; exit 2; }
work=${ER_WORK:-/tmp/trainloop_elastic_recovery.$$}
mkdir -p "$work"
lines="$work/lines.txt"
: > "$lines"
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(lscpu | sed -n 's/^Model name: *//p') $(nproc) cores; options: $*"
for rep in $(seq 1 "$repetitions"); do
  for run in "steady --elastic 0" "steady --elastic 1" "elastic" "restart" "join"; do
    # shellcheck disable=SC2086
    out=$("$program" --scenario $run --dir "$work/job" "$@" 2>"$work/stderr.txt" | grep '^elastic_recovery ')
    if [ -z "$out" ]; then echo "rep $rep $run: no result"; tail -5 "$work/stderr.txt"; continue; fi
    echo "rep $rep: $out"
    echo "$out" >> "$lines"
  done
done
python3 - "$lines" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r'(\w+)=(\S+)', line)) for line in open(sys.argv[1])]
def spread(values):
    values = sorted(values)
    return f"{statistics.median(values):.3f} ({values[0]:.3f}-{values[-1]:.3f})" if values else "-"
def pick(scenario, elastic):
    return [r for r in rows if r['scenario'] == scenario and r['elastic'] == elastic]
off, on = pick('steady', '0'), pick('steady', '1')
print(f"step time, no rank lost: elastic off {spread([float(r['step_s']) for r in off])} s, "
      f"on {spread([float(r['step_s']) for r in on])} s")
pairs = [float(b['step_s']) / float(a['step_s']) for a, b in zip(off, on) if float(a['step_s']) > 0]
print(f"ratio on/off (commit cost; with sharding also the copies'), per repetition: {spread(pairs)}")
print(f"rank 0's peak resident set, no rank lost: elastic off {spread([float(r['rank0_peak_mib']) for r in off])} MiB, "
      f"on {spread([float(r['rank0_peak_mib']) for r in on])} MiB")
for scenario, elastic in (('elastic', '1'), ('restart', '0')):
    rs = pick(scenario, elastic)
    if not rs: continue
    print(f"{scenario:8s} ranks {rs[0]['ranks']}: death to next step {spread([float(r['death_to_next_step_s']) for r in rs])} s, "
          f"to progress {spread([float(r['death_to_progress_s']) for r in rs])} s, "
          f"steps lost {sorted(int(r['steps_lost']) for r in rs)}, step before {spread([float(r['step_s']) for r in rs])} s")
rs = pick('join', '1')
if rs:
    print(f"join     ranks {rs[0]['ranks']}: death to full size again {spread([float(r['death_to_full_size_s']) for r in rs])} s; "
          f"the step interval ending with the first full-size step {spread([float(r['join_step_interval_s']) for r in rs])} s "
          f"against a step of the smaller world {spread([float(r['smaller_step_s']) for r in rs])} s and one before the death "
          f"{spread([float(r['step_s']) for r in rs])} s")
PY
rm -rf "$work"
