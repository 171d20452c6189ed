#!/usr/bin/env bash
# The example's --checkpoint-dir under sharding, end to end: `--gpu-mode ddp --sharding full` on 2
# processes writes per-rank checkpoints (directories in torch.distributed.checkpoint's layout, one
# file per rank, nothing gathered), and --resume continues from them in another mode and world
# size: in one process, then on 3 processes at sharding gradients.
#
#   tests/example_sharded_resume.sh <fashion_mnist executable> <scratch dir>
set -euo pipefail
example=$1
work=$2
rm -rf "$work"
mkdir -p "$work"
args=(--train-samples 600 --batch-size 50 --checkpoint-dir "$work/runs")

"$example" "${args[@]}" --epochs 1 --gpu-mode ddp --sharding full --procs 2 > "$work/sharded.log" 2>&1 ||
  { cat "$work/sharded.log" >&2; echo "FAIL: the sharded run failed" >&2; exit 1; }
last=$(readlink -f "$work/runs/last.ckpt")
for file in .metadata __0_0.distcp __1_0.distcp trainloop.pt; do
  [[ -f "$last/$file" ]] || { echo "FAIL: $last has no $file: $(ls -a "$last")" >&2; exit 1; }
done
echo "per-rank checkpoint: $last: $(ls -a "$last" | tr '\n' ' ')"

"$example" "${args[@]}" --epochs 2 --gpu-mode single --resume > "$work/single.log" 2>&1 ||
  { cat "$work/single.log" >&2; echo "FAIL: the single-process resume failed" >&2; exit 1; }
grep -a "resumed from" "$work/single.log" || { echo "FAIL: the single-process run did not resume" >&2; exit 1; }

# Epoch 2's checkpoint came from one process (a file); epoch 1's per-rank one is still there.
"$example" "${args[@]}" --epochs 3 --gpu-mode ddp --sharding gradients --procs 3 --resume > "$work/three.log" 2>&1 ||
  { cat "$work/three.log" >&2; echo "FAIL: the 3-process resume failed" >&2; exit 1; }
grep -a "resumed from" "$work/three.log" || { echo "FAIL: the 3-process run did not resume" >&2; exit 1; }
last=$(readlink -f "$work/runs/last.ckpt")
[[ -f "$last/__2_0.distcp" ]] || { echo "FAIL: the 3-process run's checkpoint $last has no rank 2 file" >&2; exit 1; }
grep -a "test accuracy" "$work/three.log" | tail -n 1
rm -rf "$work"
