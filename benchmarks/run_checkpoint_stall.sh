#!/bin/bash
# Issue 53: how long training waits for a checkpoint of the ~100 M-parameter MLP with Adam on 2
# CPU ranks, at each sharding level — per-rank checkpoints written behind training (the default)
# against training waiting for them, and a job without checkpoints as the baseline — and beside
# it Python's dcp.save and dcp.async_save of the same state (benchmarks/checkpoint_stall.py).
# benchmarks/checkpoint_stall.cpp runs one job per call; this script interleaves them.
#
#   benchmarks/run_checkpoint_stall.sh <build-dir> [repetitions] [levels] [extra checkpoint_stall options]
#   e.g. benchmarks/run_checkpoint_stall.sh build 2 "none optimizer gradients full" --every 4 --steps 16
#
# Each repetition, per level, in this order: no checkpoints, checkpoints behind training, and (the
# sharded levels) checkpoints training waits for. Per configuration one line:
#   <level> <how>: blocking per checkpoint <median> ms (<min>-<max>), ratio <median> (<min>-<max>)
# blocking is ModelCheckpoint::reports()' blocked_seconds on rank 0 over every checkpoint of every
# repetition; ratio is the median step time with checkpoints over the one without, per repetition
# (a checkpoint every K steps: the median step hides a stall in one step of K, so the ratio of the
# mean step times follows, as "mean ratio").
set -u
build=${1:?usage: run_checkpoint_stall.sh <build-dir> [repetitions] [levels] [options]}
repetitions=${2:-2}
levels=${3:-none optimizer gradients full}
shift 3 2>/dev/null || shift $#
program=$(cd "$build" && pwd)/benchmarks/checkpoint_stall
[ -x "$program" ] || { echo "no $program: build the trainloop_benchmarks target"; exit 2; }
python=${TRAINLOOP_PYTHON:-$HOME/.cache/trainloop/torch-2.15.0/bin/python}
work=${CS_WORK:-/tmp/trainloop_checkpoint_stall.$$}
mkdir -p "$work"
lines="$work/lines.txt"
: > "$lines"
echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores; levels: $levels; options: $*"
for rep in $(seq 1 "$repetitions"); do
  for level in $levels; do
    runs=("--checkpoints 0" "--checkpoints 1 --background 1")
    runs+=("--checkpoints 1 --background 0")  # none too: its one file goes behind training since 2026-11-29
    for run in "${runs[@]}"; do
      # shellcheck disable=SC2086
      out=$("$program" --level "$level" $run --dir "$work/job" "$@" 2>"$work/stderr.txt" | grep '^checkpoint_stall ')
      if [ -z "$out" ]; then echo "rep $rep $level $run: no result"; tail -5 "$work/stderr.txt"; continue; fi
      echo "rep $rep: $out"
      echo "rep=$rep $out" >> "$lines"
    done
  done
done
python3 - "$lines" <<'PY'
import re, statistics, sys
rows = [dict(re.findall(r'(\w+)=(\S+)', line)) for line in open(sys.argv[1])]
def spread(values, digits=2):
    values = sorted(values)
    return f"{statistics.median(values):.{digits}f} ({values[0]:.{digits}f}-{values[-1]:.{digits}f})" if values else "-"
for level in dict.fromkeys(r['level'] for r in rows):
    base = {r['rep']: r for r in rows if r['level'] == level and r['checkpoints'] == '0'}
    for background, how in (('1', 'behind training'), ('0', 'training waits')):
        with_ckpt = [r for r in rows if r['level'] == level and r['checkpoints'] == '1' and r['background'] == background]
        if not with_ckpt:
            continue
        ratios = [float(r['step_s']) / float(base[r['rep']]['step_s']) for r in with_ckpt if r['rep'] in base]
        means = [float(r['mean_step_s']) / float(base[r['rep']]['mean_step_s']) for r in with_ckpt if r['rep'] in base]
        blocking = [float(r['blocking_ms']) for r in with_ckpt]
        low = [float(r['blocking_min_ms']) for r in with_ckpt]
        high = [float(r['blocking_max_ms']) for r in with_ckpt]
        print(f"{level} {how}: blocking per checkpoint {statistics.median(blocking):.0f} ms ({min(low):.0f}-{max(high):.0f}), "
              f"ratio {spread(ratios)}, mean ratio {spread(means)}; step {spread([float(r['step_s']) for r in with_ckpt], 3)} s "
              f"vs {spread([float(b['step_s']) for b in base.values()], 3)} s without; written in "
              f"{spread([float(r['written_s']) for r in with_ckpt], 1)} s; failed {sum(int(r['failed']) for r in with_ckpt)}")
PY
if "$python" -c "import torch.distributed.checkpoint" 2>/dev/null; then
  echo "# Python $("$python" -c 'import torch; print(torch.__version__)'), the same state sharded as FSDP2 holds it (DTensors), no training in between:"
  "$python" "$(dirname "$0")/checkpoint_stall.py" --dir "$work/python" --repetitions "$repetitions" | grep '^python_dcp'
else
  echo "# Python reference skipped: no torch at $python (set TRAINLOOP_PYTHON)"
fi
rm -rf "$work"
