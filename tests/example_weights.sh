#!/usr/bin/env bash
# The example's --save-weights / --load-weights, end to end: weights saved after training, loaded
# into a run that cannot change them (--lr 0: Adam moves nothing; the net has no BatchNorm), score
# exactly what the saving run scored; the same through Hugging Face's sharded form written by fsdp
# (whose fit() leaves the whole model in the calling process); a file of another model is a clear
# error and a non-zero exit.
#
#   tests/example_weights.sh <fashion_mnist executable> <scratch dir>
set -euo pipefail
example=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
# Contiguous parameters in every run: the score compared bit for bit must come from the same kernels
# (and fsdp refuses channels-last parameters at present: "expected contiguous parameters under sharding").
args=(--epochs 1 --train-samples 256 --batch-size 64 --progress epochs --memory-format contiguous)

# The final line without its time: "test accuracy A (loss L, N test images) after 1 epochs".
score() { grep -a "test accuracy" "$1" | tail -n 1 | sed 's/^[^:]*: //; s/, [0-9.e+-]* s of training//'; }
fail() {
  echo "FAIL: $1" >&2
  shift
  for log in "$@"; do echo "--- $log" >&2; cat "$log" >&2; done
  exit 1
}

"$example" "${args[@]}" --save-weights "$work/trained.safetensors" > "$work/save.log" 2>&1 || fail "the saving run failed" "$work/save.log"
[[ -s $work/trained.safetensors ]] || fail "no $work/trained.safetensors" "$work/save.log"
trained=$(score "$work/save.log")

# fsdp (2 ranks, full sharding) loads the file, trains with lr 0 and writes the sharded form from its calling process.
"$example" "${args[@]}" --gpu-mode fsdp --procs 2 --lr 0 --load-weights "$work/trained.safetensors" \
  --save-weights "$work/sharded/" --save-weights-shard-bytes 500000 > "$work/fsdp.log" 2>&1 ||
  fail "the fsdp run failed" "$work/fsdp.log"
[[ -f $work/sharded/model.safetensors.index.json && -f $work/sharded/model-00001-of-00003.safetensors &&
   -f $work/sharded/model-00003-of-00003.safetensors ]] || fail "no 3 shards and index in $work/sharded" "$work/fsdp.log"

# The sharded weights, loaded in one process with lr 0, score what the saving run scored, bit for bit.
"$example" "${args[@]}" --lr 0 --load-weights "$work/sharded" > "$work/load.log" 2>&1 || fail "the loading run failed" "$work/load.log"
loaded=$(score "$work/load.log")
[[ -n $trained && $loaded == "$trained" ]] || fail "loaded weights score '$loaded'; expected '$trained'" "$work/save.log" "$work/load.log"

# Another model's weights: one tensor of another name and shape.
header='{"conv1.weight":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
printf "\\x$(printf %02x ${#header})\\x00\\x00\\x00\\x00\\x00\\x00\\x00%s\\x00\\x00\\x00\\x00" "$header" > "$work/other.safetensors"
if "$example" "${args[@]}" --load-weights "$work/other.safetensors" > "$work/other.log" 2>&1; then
  fail "loading another model's weights succeeded" "$work/other.log"
fi
grep -q "safetensors weights $work/other.safetensors does not fit the model: 7 missing (conv1.bias, conv2.weight" "$work/other.log" &&
  grep -q "1 wrong shape (conv1.weight is \[1\] in the file; expected \[32, 1, 3, 3\]" "$work/other.log" ||
  fail "the mismatch is not named" "$work/other.log"
echo "example_weights: saved, sharded by fsdp and reloaded weights score '$trained'; a mismatch is named and exits non-zero"
