#!/usr/bin/env bash
# The example's --checkpoint-dir / --resume, end to end: a run SIGKILLed during epoch 3 of 4 and
# rerun with --resume prints the same final test accuracy and loss as an uninterrupted run.
#
#   tests/example_resume.sh <fashion_mnist executable> <scratch dir>
set -euo pipefail
example=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
args=(--epochs 4 --train-samples 3000 --batch-size 64)

final_line() { grep -a "test accuracy" "$1" | tail -n 1 | sed 's/, [0-9.e+-]* s of training//'; }

"$example" "${args[@]}" --checkpoint-dir "$work/uninterrupted" > "$work/uninterrupted.log" 2>&1
expected=$(final_line "$work/uninterrupted.log")

"$example" "${args[@]}" --checkpoint-dir "$work/killed" > "$work/killed.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  ls "$work/killed"/epoch=0002-* > /dev/null 2>&1 && break
  sleep 0.1
done
sleep 0.3  # into epoch 3
kill -9 "$pid"
wait "$pid" 2> /dev/null || true
if grep -aq "test accuracy" "$work/killed.log"; then
  echo "FAIL: the run finished before it could be killed" >&2
  exit 1
fi
echo "killed during epoch 3; checkpoints: $(ls "$work/killed" | tr '\n' ' ')"

"$example" "${args[@]}" --checkpoint-dir "$work/killed" --resume > "$work/resumed.log" 2>&1
got=$(final_line "$work/resumed.log")
grep -a "resumed from" "$work/resumed.log" || { echo "FAIL: the rerun did not resume" >&2; exit 1; }
echo "uninterrupted: $expected"
echo "resumed:       $got"
if [[ "$expected" != "$got" ]]; then
  echo "FAIL: the resumed run's final result differs" >&2
  exit 1
fi
rm -rf "$work"
