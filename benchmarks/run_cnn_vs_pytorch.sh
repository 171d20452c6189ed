#!/usr/bin/env bash
# The Fashion-MNIST CNN trained by trainloop (compare_modes: hand, single, ddp, at trainloop's
# defaults) and by Python PyTorch (single and DDP, at PyTorch's defaults and tuned), alternated
# repetition by repetition on the same samples:
#
#   benchmarks/run_cnn_vs_pytorch.sh [build-dir] [repetitions] [samples] [precision] [memory-format]
#
# precision fp32|bf16 and memory-format contiguous|channels-last apply to both sides (trainloop's
# modes and Python; the hand loop stays fp32 contiguous), e.g. ... build 3 6400 bf16 channels-last.
#
# "tuned" is the best environment found for Python on this machine: OMP_NUM_THREADS=<cores>
# OPENBLAS_NUM_THREADS=1 in one process, OMP_NUM_THREADS=1 per DDP rank, and glibc keeping freed
# memory (GLIBC_TUNABLES, as trainloop does itself). Needs Debian's python3-torch (the same
# libtorch 1.13): scripts/install-deps.sh --benchmarks.
set -euo pipefail
build=${1:-build}
reps=${2:-3}
samples=${3:-6400}
precision=${4:-fp32}
memory_format=${5:-contiguous}
same=(--precision "$precision" --memory-format "$memory_format")
here=$(cd "$(dirname "$0")" && pwd)
cores=$(nproc)
keep="glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=536870912"
python_single() { /usr/bin/python3 "$here/cnn_pytorch.py" --mode single --samples "$samples" "${same[@]}" | grep RESULT; }
python_ddp() { /usr/bin/python3 "$here/cnn_pytorch.py" --mode ddp --ranks 2 --samples "$samples" "${same[@]}" | grep RESULT; }
for rep in $(seq 1 "$reps"); do
  echo "== repetition $rep"
  "$build/benchmarks/compare_modes" --workload cnn --samples "$samples" --repetitions 1 --modes hand,single,ddp \
    --procs 2 "${same[@]}" --csv /tmp/run_cnn_vs_pytorch.csv | grep -E "^(hand|single|ddp) |^threads"
  echo "python single default: $(python_single)"
  echo "python single tuned:   $(export OMP_NUM_THREADS=$cores OPENBLAS_NUM_THREADS=1 GLIBC_TUNABLES=$keep; python_single)"
  echo "python ddp default:    $(python_ddp)"
  echo "python ddp tuned:      $(export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 GLIBC_TUNABLES=$keep; python_ddp)"
done
