#!/usr/bin/env bash
# What the stall watchdog costs a DDP step: ddp_overlap (2 CPU ranks, Gloo, a small MLP so a step
# is short and any per-step cost shows) run with the watchdog on (the default) and off
# (TRAINLOOP_STALL_LIMIT=off), interleaved, N times each (the machine is shared: the order
# alternates). Prints every run's median step time, then each side's median and spread (min-max)
# and the median of the per-pair ratios on/off.
#
#   benchmarks/run_stall_watch_cost.sh <build-dir> [pairs=7] [ddp_overlap flags...]
set -euo pipefail
build=${1:?usage: run_stall_watch_cost.sh <build-dir> [pairs] [flags]}
pairs=${2:-7}
shift $(( $# >= 2 ? 2 : 1 ))
flags=("$@")
[[ ${#flags[@]} -gt 0 ]] || flags=(--repetitions 1 --layers 2 --width 256 --batch-size 8 --steps 200)
bench=$build/benchmarks/ddp_overlap
step_of() {  # the overlap=true median step seconds of one run
  "$@" "$bench" "${flags[@]}" | sed -nE 's/^median step seconds: overlap=true ([0-9.]+).*/\1/p'
}
on=() off=() ratios=()
for ((i = 0; i < pairs; i++)); do
  if ((i % 2 == 0)); then
    a=$(step_of env); b=$(step_of env TRAINLOOP_STALL_LIMIT=off)
  else
    b=$(step_of env TRAINLOOP_STALL_LIMIT=off); a=$(step_of env)
  fi
  on+=("$a"); off+=("$b"); ratios+=("$(python3 -c "print($a / $b)")")
  echo "pair $i: watchdog on ${a}s  off ${b}s  on/off $(python3 -c "print(round($a / $b, 4))")"
done
python3 - "${on[*]}" "${off[*]}" "${ratios[*]}" <<'PY'
import statistics, sys
on, off, ratios = ([float(x) for x in arg.split()] for arg in sys.argv[1:4])
for name, values in (("on", on), ("off", off)):
    print(f"watchdog {name}: median step {statistics.median(values) * 1e3:.3f} ms  spread {min(values) * 1e3:.3f}-{max(values) * 1e3:.3f} ms")
print(f"median ratio on/off: {statistics.median(ratios):.4f}  (spread {min(ratios):.4f}-{max(ratios):.4f})")
PY
