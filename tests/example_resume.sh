#!/usr/bin/env bash
# The example's --checkpoint-dir / --resume, end to end: a run SIGKILLed during epoch 3 of 4 and
# rerun with --resume prints the same final test accuracy and loss as an uninterrupted run.
#
# The kill waits for an event, not for a time: the run's live progress bar (--progress live)
# comes through a FIFO, and the first redraw of epoch 3 (drawn after its first batch, so after
# epoch 2's checkpoint) triggers it. A sleep "into epoch 3" missed epoch 3 on a fast machine.
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

mkfifo "$work/killed.fifo"
"$example" "${args[@]}" --progress live --checkpoint-dir "$work/killed" > "$work/killed.fifo" 2>&1 &
pid=$!
# Each redraw of the bar begins with '\r': read the output one redraw at a time as it comes (the
# log keeps it), and kill at the first one of epoch 3. At the end of the output (the run ended
# without reaching epoch 3), read fails and the loop ends with the last piece.
killed=false
while IFS= read -r -d $'\r' piece || [[ -n $piece ]]; do
  printf '%s\r' "$piece" >> "$work/killed.log"
  if [[ $piece == "epoch 3/4 ["* ]]; then
    kill -9 "$pid" || true
    killed=true
    break
  fi
done < "$work/killed.fifo"
wait "$pid" 2> /dev/null || true
if ! $killed || grep -aq "test accuracy" "$work/killed.log"; then
  echo "FAIL: the run ended before it could be killed in epoch 3; its output:" >&2
  tr '\r' '\n' < "$work/killed.log" >&2
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
