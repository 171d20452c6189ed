#!/bin/bash
# Issue 42: a ~100 M-parameter MLP with Adam (DeepLinear, 6 x 4096) trained by a WHOLE 2-rank CPU
# job under one cgroup memory limit. The ranks are started by hand with torchrun's variables
# (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT): no launching process
# holds the model. benchmarks/model_bigger_than_a_rank.cpp is one rank.
#
#   benchmarks/run_memory_limit.sh <build-dir> [repetitions] [limit-MiB|auto]
#   MBR_ONLY_LIMITED=1 benchmarks/run_memory_limit.sh <build-dir> 0 <limit-MiB>   (part 2 only)
#
# 1. Without a limit (each job still in a cgroup of its own, to read its peak), repetitions
#    interleaved and rotated: every level (none = plain DDP, optimizer = ZeRO-1, gradients, full)
#    trains 3 steps per rank, validates, writes a checkpoint (ModelCheckpoint) and exits; then 2
#    ranks resume from it (checkpoint load timed) and train one more epoch. none and full run every
#    repetition (the checkpoint write/load times), optimizer and gradients the first only
#    (MBR_ALL_LEVELS_REPS to change). Peak resident set per rank and phase, job peaks.
# 2. The limit: the given MiB, or (auto) halfway between full's and plain DDP's job peak (the sum
#    of the ranks' peaks, medians over the repetitions), rounded down to 100 MiB. Under it: full
#    trains + validates + checkpoints on 2 ranks; resumes on 3 ranks under the same limit
#    (load_checkpoint before fit(), and fit(..., Resume::from)) and under the limit x 3/2; the checkpoint is read by one process (load_dcp_weights: weights only; and
#    TrainLoop::load_checkpoint in gpu_mode::Single: weights and the whole Adam state); plain DDP
#    trains on 2 ranks (the control: killed by the kernel's OOM killer).
#
# Needs root and a memory controller: cgroup v1 (a child of this process's memory cgroup,
# memory.limit_in_bytes and memory.memsw.limit_in_bytes) or v2 (memory.max, memory.swap.max).
# Otherwise it says "skipped" and why.
set -u
# glibc: a fixed mmap threshold returns every freed block >= 1 MiB to the system (see
# run_zero_memory.sh: without it full sharding's freed 64 MiB units stay in the heap).
export MALLOC_MMAP_THRESHOLD_=${MALLOC_MMAP_THRESHOLD_:-1048576}
build=${1:?usage: run_memory_limit.sh <build-dir> [repetitions] [limit-MiB|auto]}
repetitions=${2:-3}
limit_arg=${3:-auto}
all_levels_reps=${MBR_ALL_LEVELS_REPS:-1}
program=$(cd "$build" && pwd)/benchmarks/model_bigger_than_a_rank
work=${MBR_WORK:-/tmp/trainloop_memory_limit.$$}
[ -x "$program" ] || { echo "no $program: build the model_bigger_than_a_rank target"; exit 2; }

# --- the cgroup ------------------------------------------------------------------------------
cg_version=""
cg_parent=""
if [ "$(id -u)" != 0 ]; then
  echo "skipped: not root (uid $(id -u)); a memory cgroup cannot be created"
  exit 0
fi
v1_own=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3}' /proc/self/cgroup | head -1)
if [ -n "$v1_own" ] && [ -w "/sys/fs/cgroup/memory${v1_own}" ] && [ -e "/sys/fs/cgroup/memory${v1_own}/memory.limit_in_bytes" ]; then
  cg_version=1
  cg_parent=/sys/fs/cgroup/memory${v1_own%/}
elif [ -e /sys/fs/cgroup/cgroup.controllers ] && grep -qw memory /sys/fs/cgroup/cgroup.controllers; then
  v2_own=$(awk -F: '$1 == "0" {print $3}' /proc/self/cgroup)
  # A v2 group holding processes cannot enable controllers for children: use the root's.
  cg_parent=/sys/fs/cgroup
  if echo +memory > "$cg_parent/cgroup.subtree_control" 2>/dev/null || grep -qw memory "$cg_parent/cgroup.subtree_control"; then
    cg_version=2
  fi
  : "${v2_own}"
fi
if [ -z "$cg_version" ]; then
  echo "skipped: no writable memory cgroup controller (v1: /sys/fs/cgroup/memory/<own group>/memory.limit_in_bytes; v2: memory in /sys/fs/cgroup/cgroup.controllers)"
  exit 0
fi
probe="$cg_parent/trainloop_probe_$$"
if ! mkdir "$probe" 2>/dev/null; then
  echo "skipped: cannot create a cgroup under $cg_parent"
  exit 0
fi
rmdir "$probe"
mkdir -p "$work"
records=$work/records.txt  # the ranks' lines (model_bigger_than_a_rank --record)
jobs=$work/jobs.txt        # one line per job: its cgroup's counters and the ranks' exit statuses
: > "$records"
: > "$jobs"
echo "cgroup v$cg_version under $cg_parent; MALLOC_MMAP_THRESHOLD_=$MALLOC_MMAP_THRESHOLD_; $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"

group_count=0
group=""
# A job interrupted: its group goes too (once its ranks are gone).
trap '[ -n "$group" ] && rmdir "$group" 2>/dev/null' EXIT
# make_group <limit-MiB or 0>: a fresh group (path in $group) limited to that (0: no limit).
make_group() {
  group_count=$((group_count + 1))
  group="$cg_parent/trainloop_mbr_$$_$group_count"
  mkdir "$group" || return 1
  if [ "$1" -gt 0 ]; then
    local bytes=$(($1 * 1024 * 1024))
    if [ "$cg_version" = 1 ]; then
      echo "$bytes" > "$group/memory.limit_in_bytes" || return 1
      # Swap may not hide the excess (memsw: memory + swap, >= the memory limit).
      if [ -e "$group/memory.memsw.limit_in_bytes" ]; then echo "$bytes" > "$group/memory.memsw.limit_in_bytes" || return 1; fi
    else
      echo "$bytes" > "$group/memory.max" || return 1
      if [ -e "$group/memory.swap.max" ]; then echo 0 > "$group/memory.swap.max" || return 1; fi
    fi
  fi
}
# group_counters: the group's peak (MiB) and OOM evidence, as key=value.
group_counters() {
  if [ "$cg_version" = 1 ]; then
    echo "job_peak_mib=$(($(cat "$group/memory.max_usage_in_bytes") / 1048576))" \
      "failcnt=$(cat "$group/memory.failcnt")" \
      "oom_kill=$(awk '$1 == "oom_kill" {print $2}' "$group/memory.oom_control")"
  else
    local peak=0
    [ -e "$group/memory.peak" ] && peak=$(($(cat "$group/memory.peak") / 1048576))
    echo "job_peak_mib=$peak" \
      "failcnt=$(awk '$1 == "max" {print $2}' "$group/memory.events")" \
      "oom_kill=$(awk '$1 == "oom_kill" {print $2}' "$group/memory.events")"
  fi
}
drop_group() { rmdir "$group" 2>/dev/null || true; }

# run_job <label> <limit-MiB or 0> <world> <phase> <level> <checkpoints> [flag]: the ranks, joined,
# in one fresh group; appends a line to $jobs; $job_line holds it.
run_job() {
  local label=$1 limit=$2 world=$3 phase=$4 level=$5 checkpoints=$6 flags=("${@:7}")
  make_group "$limit" || { echo "cannot create or limit a cgroup under $cg_parent"; exit 1; }
  local port=$((20000 + RANDOM % 20000))
  local pids=() rank start end
  start=$(date +%s.%N)
  for ((rank = 0; rank < world; rank++)); do
    if [ "$world" -gt 1 ]; then
      # The subshell enters the group, then becomes the rank (exec): nothing else is in it.
      ( echo "$BASHPID" > "$group/cgroup.procs" &&
        exec env RANK=$rank WORLD_SIZE=$world LOCAL_RANK=$rank LOCAL_WORLD_SIZE=$world MASTER_ADDR=127.0.0.1 \
          MASTER_PORT=$port "$program" --phase "$phase" --level "$level" --checkpoints "$checkpoints" --record "$records" "${flags[@]}"
      ) > "$work/$label.rank$rank.log" 2>&1 &
    else
      ( echo "$BASHPID" > "$group/cgroup.procs" &&
        exec "$program" --phase "$phase" --level "$level" --checkpoints "$checkpoints" --record "$records"
      ) > "$work/$label.rank$rank.log" 2>&1 &
    fi
    pids+=($!)
  done
  local statuses=""
  for ((rank = 0; rank < world; rank++)); do
    wait "${pids[$rank]}"
    statuses="$statuses${statuses:+,}$?"
  done
  end=$(date +%s.%N)
  job_line="job=$label phase=$phase level=$level world=$world limit_mib=$limit rep=$current_rep exit=$statuses $(group_counters) seconds=$(awk "BEGIN {printf \"%.1f\", $end - $start}")"
  # The ranks' lines carry no job name: tag the new ones.
  sed -i "/ job=/! s/\$/ job=$label rep=$current_rep limit_mib=$limit/" "$records"
  echo "$job_line" >> "$jobs"
  echo "  $job_line"
  drop_group
}
# job_failed: true when a rank of the last job exited non-zero.
job_failed() { [[ "$job_line" =~ exit=[0,]*[1-9] ]]; }
# report_oom <name> <limit>: the control's verdict from the exit statuses and the group's counters.
report_oom() {
  local name=$1 limit=$2 statuses oom
  statuses=$(sed 's/.* exit=\([^ ]*\).*/\1/' <<< "$job_line")
  oom=$(sed 's/.* oom_kill=\([^ ]*\).*/\1/' <<< "$job_line")
  if [[ ",$statuses," == *",137,"* ]] && [ "${oom:-0}" -gt 0 ]; then
    local rank killed=""
    IFS=, read -ra codes <<< "$statuses"
    for rank in "${!codes[@]}"; do [ "${codes[$rank]}" = 137 ] && killed="$killed${killed:+, }rank $rank"; done
    echo "$name: killed by the kernel's OOM killer under the $limit MiB limit ($killed: SIGKILL, exit status 137; the cgroup's oom_kill count $oom)"
    for rank in "${!codes[@]}"; do
      [ "${codes[$rank]}" != 137 ] && [ "${codes[$rank]}" != 0 ] &&
        echo "  rank $rank exited ${codes[$rank]}: $(grep -m1 ERROR "$work/$name-limited.rank$rank.log" | cut -c1-300)"
    done
  elif job_failed; then
    echo "$name: failed under the $limit MiB limit, but not by the OOM killer (exit statuses $statuses, oom_kill $oom); see $work/$name-limited.rank*.log"
  else
    echo "$name: passed under the $limit MiB limit (exit statuses $statuses)"
  fi
}

# --- 1. without a limit ----------------------------------------------------------------------
only_limited=${MBR_ONLY_LIMITED:-0}  # 1 (with a given limit): part 2 only
if [ "$only_limited" = 1 ] && [ "$limit_arg" = auto ]; then echo "MBR_ONLY_LIMITED=1 needs a limit in MiB"; exit 2; fi
[ "$only_limited" = 1 ] && repetitions=0
levels="none optimizer gradients full"
echo "== 1. no limit: $repetitions repetitions, interleaved (none and full every repetition, optimizer and gradients $all_levels_reps)"
current_rep=0
for ((rep = 1; rep <= repetitions; rep++)); do
  current_rep=$rep
  for level in $levels; do
    if [ "$level" = optimizer ] || [ "$level" = gradients ]; then [ "$rep" -le "$all_levels_reps" ] || continue; fi
    ck="$work/ck-$level-$rep"
    rm -rf "$ck"
    echo "rep $rep, $level"
    run_job "$level-train-rep$rep" 0 2 train "$level" "$ck"
    run_job "$level-resume-rep$rep" 0 2 resume "$level" "$ck"
    [ "$level" = full ] && [ "$rep" = 1 ] && mv "$ck" "$work/ck-full-kept" || rm -rf "$ck"
  done
  levels=$(echo "$levels" | awk '{print $2, $3, $4, $1}')  # rotate the order
done

# --- the tables ------------------------------------------------------------------------------
tables() {
  python3 - "$records" "$jobs" "$@" <<'EOF'
import statistics, sys
records, jobs = sys.argv[1], sys.argv[2]
def parse(line):
    return dict(kv.split('=', 1) for kv in line.split() if '=' in kv)
rows = [parse(l) for l in open(records) if l.strip()]
job_rows = [parse(l) for l in open(jobs) if l.strip()]
def med(values):
    values = [float(v) for v in values]
    if not values: return '-'
    m = statistics.median(values)
    if len(values) == 1: return f'{m:,.0f}' if m >= 100 else f'{m:.2f}'
    fmt = (lambda v: f'{v:,.0f}') if m >= 100 else (lambda v: f'{v:.2f}')
    return f'{fmt(m)} [{fmt(min(values))}-{fmt(max(values))}]'
levels = ['none', 'optimizer', 'gradients', 'full']
names = {'none': 'none (DDP)', 'optimizer': 'optimizer (ZeRO-1)', 'gradients': 'gradients', 'full': 'full'}
# Records of the unlimited runs only: they come first; the limited runs are in jobs with limit_mib > 0.
unlimited = [r for r in rows if r.get('limit_mib') == '0']
print('\nPeak resident set per rank and phase, MiB, no limit, median [min-max] over the repetitions (n)')
print('| level | rank | process | model built | setup | steps | evaluation | checkpoint write | resume: prepared | checkpoint load | resume: load to fit begin | resumed steps | resumed evaluation | whole run (train / resume) |')
print('|---|---|---|---|---|---|---|---|---|---|---|---|---|---|')
for level in levels:
    for rank in ('0', '1'):
        t = [r for r in unlimited if r['level'] == level and r['rank'] == rank and r['phase'] == 'train' and r['world'] == '2']
        s = [r for r in unlimited if r['level'] == level and r['rank'] == rank and r['phase'] == 'resume' and r['world'] == '2']
        if not t: continue
        g = lambda rs, k: med([r[k] for r in rs if k in r])
        print(f"| {names[level]} (n={len(t)}) | {rank} | {g(t,'process_rss')} | {g(t,'model_rss')} | {g(t,'setup_peak')} | {g(t,'steps_peak')} | {g(t,'eval_peak')} | {g(t,'ckpt_write_peak')} | {g(s,'prepared_peak')} | {g(s,'ckpt_load_peak')} | {g(s,'setup_peak')} | {g(s,'steps_peak')} | {g(s,'eval_peak')} | {g(t,'maxrss')} / {g(s,'maxrss')} |")
print('\nJob peaks, MiB, no limit: the sum of the ranks\' peaks (training run), and the cgroup\'s memory.max_usage_in_bytes (resident + page cache of the files written: the kernel reclaims the latter under a limit)')
print('| level | sum of rank peaks (train) | cgroup peak (train) | cgroup peak (resume, 2 ranks) | goal: 16 B x P / W + 2 units + process, per rank |')
print('|---|---|---|---|---|')
goal = {}
for level in levels:
    t = [r for r in unlimited if r['level'] == level and r['phase'] == 'train' and r['world'] == '2']
    if not t: continue
    reps = sorted({r.get('rep') for r in t})
    sums = []
    by_job = {}
    for r in t: by_job.setdefault(r['job'], []).append(float(r['maxrss']))
    sums = [sum(v) for v in by_job.values()]
    jt = [j['job_peak_mib'] for j in job_rows if j['level'] == level and j['phase'] == 'train' and j['limit_mib'] == '0']
    jr = [j['job_peak_mib'] for j in job_rows if j['level'] == level and j['phase'] == 'resume' and j['limit_mib'] == '0']
    P = float(t[0]['parameters']); W = 2
    process = statistics.median(float(r['process_rss']) for r in t)
    g = 16 * P / W / 2**20 + 2 * 64 + process if level == 'full' else None
    print(f"| {names[level]} | {med(sums)} | {med(jt)} | {med(jr)} | {'%.0f' % g if g else '-'} |")
print('\nCheckpoint write and load per rank, seconds, 2 ranks, median [min-max] over the repetitions (n); sizes')
print('| level | rank | write (in ModelCheckpoint) | load (TrainLoop::load_checkpoint, resume) | checkpoint bytes | step time |')
print('|---|---|---|---|---|---|')
for level in levels:
    for rank in ('0', '1'):
        t = [r for r in unlimited if r['level'] == level and r['rank'] == rank and r['phase'] == 'train' and r['world'] == '2']
        s = [r for r in unlimited if r['level'] == level and r['rank'] == rank and r['phase'] == 'resume' and r['world'] == '2']
        if not t: continue
        print(f"| {names[level]} (n={len(t)}) | {rank} | {med([r['ckpt_write_s'] for r in t])} | {med([r['ckpt_load_s'] for r in s])} | {t[0]['ckpt_bytes']} | {med([r['step_s_median'] for r in t])} |")
EOF
}
[ "$only_limited" = 1 ] || tables

# --- 2. under the limit ----------------------------------------------------------------------
if [ "$limit_arg" = auto ]; then
  limit=$(python3 - "$records" <<'EOF'
import statistics, sys
rows = [dict(kv.split('=', 1) for kv in l.split() if '=' in kv) for l in open(sys.argv[1]) if l.strip()]
def job_sum(level):
    jobs = {}
    for r in rows:
        if r['level'] == level and r['phase'] == 'train' and r['limit_mib'] == '0' and 'maxrss' in r:
            jobs.setdefault(r['job'], []).append(float(r['maxrss']))
    return statistics.median(sum(v) for v in jobs.values())
full, ddp = job_sum('full'), job_sum('none')
print(int((full + ddp) / 2) // 100 * 100)
EOF
  )
  echo; echo "== 2. limit: $limit MiB for the whole job, halfway between full's and plain DDP's job peaks (sums of the ranks' peaks, medians)"
else
  limit=$limit_arg
  echo; echo "== 2. limit: $limit MiB for the whole job (given)"
fi
current_rep=0
ck="$work/ck-limited"
rm -rf "$ck"
echo "full, 2 ranks: train 3 steps, validate, checkpoint, exit"
run_job full-limited "$limit" 2 train full "$ck"
report_oom full "$limit"
if ! job_failed; then
  echo "full, 3 ranks: resume from that checkpoint (load, one epoch, validate), the same job-wide limit"
  run_job full-resume3-limited "$limit" 3 resume full "$ck"
  report_oom full-resume3 "$limit"
  echo "full, 3 ranks: resume inside fit (fit(1, ..., Resume::from(checkpoint))), the same job-wide limit"
  run_job full-resume3-infit-limited "$limit" 3 resume full "$ck" --resume-in-fit
  report_oom full-resume3-infit "$limit"
  limit3=$((limit * 3 / 2))
  echo "full, 3 ranks: resume, the limit scaled for 3 ranks (x 3/2)"
  run_job full-resume3-scaled-limited "$limit3" 3 resume full "$ck"
  report_oom full-resume3-scaled "$limit3"
  echo "one process: load_dcp_weights (the weights only) into a whole DeepLinear"
  run_job read-weights-limited "$limit" 1 read-weights full "$ck"
  report_oom read-weights "$limit"
  echo "one process, gpu_mode::Single: TrainLoop::load_checkpoint (the weights and the whole Adam state)"
  run_job read-loop-limited "$limit" 1 read-loop full "$ck"
  report_oom read-loop "$limit"
fi
rm -rf "$ck"
echo "none (plain DDP), 2 ranks: the control"
run_job DDP-limited "$limit" 2 train none "$work/ck-ddp-limited"
report_oom DDP "$limit"
rm -rf "$work/ck-ddp-limited" "$work/ck-full-kept"

python3 - "$records" <<'EOF'
import sys
rows = [dict(kv.split('=', 1) for kv in l.split() if '=' in kv) for l in open(sys.argv[1]) if l.strip()]
print('\nUnder the limit: peak resident set per rank and phase, MiB (one run each)')
print('| job | limit MiB | rank | process | model built | setup (resume: load to fit begin) | steps | evaluation | checkpoint write | resume: prepared | checkpoint load | read (one process) | whole run | seconds |')
print('|---|---|---|---|---|---|---|---|---|---|---|---|---|---|')
for r in rows:
    if r.get('limit_mib', '0') == '0': continue
    g = lambda k: r.get(k, '-')
    read_s = f" ({r['read_s']} s)" if 'read_s' in r else ''
    load_s = f" ({r['ckpt_load_s']} s)" if 'ckpt_load_s' in r else ''
    print(f"| {r['job']} | {r['limit_mib']} | {r['rank']}/{r['world']} | {g('process_rss')} | {g('model_rss')} | {g('setup_peak')} | {g('steps_peak')} | {g('eval_peak')} | {g('ckpt_write_peak')} | {g('prepared_peak')} | {g('ckpt_load_peak')}{load_s} | {g('read_peak')}{read_s} | {g('maxrss')} | {g('total_s')} |")
EOF
echo; echo "jobs (cgroup counters, exit statuses):"; cat "$jobs"
echo "records: $records; logs: $work"
