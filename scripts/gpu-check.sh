#!/usr/bin/env bash
# The GPU checklist, run on a machine with an NVIDIA GPU and pip torch (2.x, CUDA): builds
# trainloop against the wheel's libtorch, runs the test suite and the example on cuda:0 in every
# mode, and writes logs to OUT_DIR (at most 8 files: what a device call brings back).
#
#   scripts/gpu-check.sh DEPS_DIR OUT_DIR [STEPS]
#
# DEPS_DIR is what scripts/gather-gpu-deps.sh made on a Debian machine (headers the GPU machine
# lacks, and the Fashion-MNIST data). STEPS (default "probe build test example speed zoo models rest") picks
# steps (`suite`: the ctest suite beyond test_cuda; `models`: item 6's TorchScript, Python weights and torch.export on CUDA, and item 7's
# image folder). The device time a session gets is short (15 minutes, its start included), so:
#   TARGETS="test_cuda fashion_mnist ..."  build only these first (default: everything);
#   DEADLINE=<seconds>                      every step stops by then, counted from the script's start;
#   DEADLINE_AT=<epoch seconds>             the same as a point in time (`date +%s`), for several calls of
#                                           this script in one device call (one building while another tests);
#   REPS=<n>                                repetitions of the speed comparisons (default 3);
#   rest                                    builds everything else last, until the deadline: the
#                                           compiler's warnings of the whole project there.
set -uo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=$(cd "$1" && pwd)
out=$2
steps=${3:-probe build test example speed zoo models rest}
started=$SECONDS
deadline=${DEADLINE:-100000}
[[ -n ${DEADLINE_AT:-} ]] && deadline=$((DEADLINE_AT - $(date +%s)))
reps=${REPS:-3}
# What is left of the deadline, at most $1 seconds (a step's own cap), at least 1.
left() { local l=$((deadline - (SECONDS - started))); ((l > $1)) && l=$1; ((l < 1)) && l=1; echo "$l"; }
mkdir -p "$out"
build=${BUILD_DIR:-/tmp/trainloop-gpu-build}
python=${PYTHON:-python3}
torch_prefix=$("$python" -c 'import torch;print(torch.utils.cmake_prefix_path)')
torch_include=$("$python" -c 'import torch, os;print(os.path.join(os.path.dirname(torch.__file__), "include"))')

has() { [[ " $steps " == *" $1 "* ]]; }

if has probe; then
  {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$python" -c 'import torch;print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "cxx11abi", torch.compiled_with_cxx11_abi())'
    cmake --version | head -1; ninja --version; c++ --version | head -1; nproc
    echo "torch include: $torch_include"
    ls "$torch_include" | head -50
    echo "gloo headers in the wheel: $(ls -d "$torch_include"/gloo 2>/dev/null || echo none)"
    ls "$torch_include"/torch/csrc/distributed/c10d/ | head -80
    grep -n "shutdown\|abort(" "$torch_include"/torch/csrc/distributed/c10d/Backend.hpp \
      "$torch_include"/torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp | head -20
    grep -n "  Error(" "$torch_include"/c10/util/Exception.h | head
    for h in boost/test/included/unit_test.hpp range/v3/all.hpp CLI/CLI.hpp zlib.h; do
      echo "system $h: $(ls /usr/include/$h 2>/dev/null || echo absent)"
    done
  } > "$out/probe.log" 2>&1
fi

gloo_include=""
if [[ ! -d $torch_include/gloo ]]; then
  # The wheel compiles Gloo in but ships no headers of it; Debian's declare the same classes.
  gloo_include="-DTRAINLOOP_GLOO_INCLUDE_DIR=$deps/gloo/include"
fi

zlib_library=$(ls /usr/lib/x86_64-linux-gnu/libz.so /usr/lib/x86_64-linux-gnu/libz.so.1 /lib/x86_64-linux-gnu/libz.so.1 2>/dev/null | head -1)
timer=(); [[ -x /usr/bin/time ]] && timer=(/usr/bin/time -v)

if has build; then
  {
    timeout "$(left 180)" cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      "-DCMAKE_PREFIX_PATH=$torch_prefix;$deps/prefix" $gloo_include \
      -DZLIB_INCLUDE_DIR="$deps/prefix/include" ${zlib_library:+-DZLIB_LIBRARY=$zlib_library} -DCMAKE_CUDA_ARCHITECTURES=90 &&
    timeout "$(left 100000)" cmake --build "$build" -j "$(nproc)" ${TARGETS:+--target $TARGETS} -- -k 0
  } > "$out/build.log" 2>&1
  echo "build exit $? after $((SECONDS - started)) s" >> "$out/build.log"
fi

export TRAINLOOP_FASHION_MNIST_DIR=$deps/data  # the Debian package is not installed there
if has test; then
  {
    # test_cuda first and on its own, with its measured differences printed (--log_level=message).
    if [[ -x $build/tests/test_cuda ]]; then
      timeout "$(left 300)" "$build/tests/test_cuda" --log_level=message
      echo "test_cuda exit $?"
    fi
    if [[ -z ${TARGETS:-} ]]; then
      (cd "$build" && timeout "$(left 100000)" ctest --output-on-failure -j 4 --timeout 600)
      echo "ctest exit $?"
    fi
  } > "$out/test.log" 2>&1
  # A crash in a test: where (the machine has cuda-gdb, which debugs host code too, but no gdb).
  if grep -q "memory access violation\|Segmentation fault" "$out/test.log" && command -v cuda-gdb > /dev/null; then
    timeout "$(left 120)" cuda-gdb -batch -ex run -ex bt --args "$build/tests/test_cuda" >> "$out/test.log" 2>&1
  fi
fi

if has suite; then
  # The ctest suite on the GPU machine beyond test_cuda (which `test` runs), until the deadline: first
  # the programs whose code takes another path where CUDA is present (DataParallel's devices, the
  # random state checkpointed, pinned batches, a device given by name), then the rest.
  {
    stop=$(date -d "+$(left 100000) seconds" +%H:%M:%S)
    first='test_data_parallel|test_train_loop|test_memory_format|test_recipe|test_relayed_exceptions|test_dcp_format|test_ddp|test_safetensors|test_checkpoint'
    (cd "$build" && ctest -R "$first" -E test_cuda -j 8 --timeout 300 --stop-time "$stop" --output-on-failure)
    echo "ctest (programs with CUDA paths) exit $?"
    (cd "$build" && ctest -E "test_cuda|$first" -j 8 --timeout 300 --stop-time "$stop" --output-on-failure)
    echo "ctest (the rest) exit $?"
  } > "$out/suite.log" 2>&1
fi

if has example; then
  # Every mode on cuda:0 (ddp and fsdp: one NCCL rank), and bf16: the test accuracy of each.
  for run in "single" "dp" "ddp --procs 1" "fsdp --procs 1" "ddp --procs 1 --sharding optimizer" "single --precision bf16"; do
    echo "== fashion_mnist --gpu-mode $run"
    # shellcheck disable=SC2086
    timeout "$(left 120)" "${timer[@]}" "$build/examples/fashion_mnist" --gpu-mode $run --device cuda:0 \
      --epochs "${EPOCHS:-2}" --data "$deps/data" --workers 2 --progress epochs 2>&1 | grep -v "^\s*$" | tail -25
    echo "exit ${PIPESTATUS[0]}"
  done > "$out/example.log" 2>&1
fi

if has speed; then
  # GPU checklist item 5: a matmul-bound MLP (784 -> 4096 x 4 -> 10, fp32) trained by the hand
  # loop and by TrainLoop in every mode (compare_modes) and by the same loop in Python PyTorch,
  # alternated repetition by repetition.
  {
    for ((rep = 1; rep <= reps; rep++)); do
      timeout "$(left 120)" "$build/benchmarks/compare_modes" --workload mlp --mlp-width 4096 --mlp-layers 4 --samples 65536 \
        --batch-size 512 --device cuda:0 --replicas 1 --procs 1 --repetitions 1 --modes hand,single,dp,ddp \
        --csv "/tmp/compare_modes_mlp_$rep.csv"
      timeout "$(left 120)" "$python" "$repo/benchmarks/mlp_pytorch.py" --device cuda:0 --width 4096 --layers 4 --samples 65536 \
        --batch-size 512 --repetitions 1
    done
    timeout "$(left 180)" "$build/benchmarks/compare_modes" --workload cnn --samples 12800 --batch-size 64 --device cuda:0 \
      --replicas 1 --procs 1 --repetitions "$reps" --modes hand,single,dp,ddp --data "$deps/data" --csv /tmp/compare_modes_cnn.csv
  } > "$out/speed.log" 2>&1
  echo "speed exit $?" >> "$out/speed.log"
fi

if has zoo; then
  # GPU checklist item 6: resnet50 at 224 px, bf16 autocast, channels-last, batch 128, 20 steps per
  # epoch (epoch 1 warm-up): trainloop (the zoo's resnet50) and Python (torchvision's) alternated.
  {
    common=(--arch resnet50 --size 224 --batch-size 128 --steps 20 --epochs 2 --mode single --device cuda:0
            --precision bf16 --memory-format channels-last)
    for ((rep = 1; rep <= reps; rep++)); do
      timeout "$(left 120)" "$build/benchmarks/zoo_vs_pytorch" "${common[@]}"
      timeout "$(left 120)" "$python" "$repo/benchmarks/zoo_vs_pytorch.py" "${common[@]}"
    done
  } > "$out/zoo.log" 2>&1
  echo "zoo exit $?" >> "$out/zoo.log"
fi

if has models; then
  # GPU checklist items 6 and 7 beyond the zoo: torchvision's resnet18 as a TorchScript model and as
  # a torch.export program trained on cuda:0 in bf16, a Python state_dict of resnet50 evaluated on
  # cuda:0 and on the CPU (the same loss expected), all from an image folder (PPM: the machine has
  # no libjpeg/libpng) decoded by 8 loader threads; then the exported program against Python eager
  # and torch.compile on the same model and loop (synthetic batches), alternated REPS times.
  {
    models=/tmp/trainloop-gpu-models
    timeout "$(left 120)" "$python" "$repo/scripts/gpu-check-models.py" "$models" --size 224 --images 64
    folder=(--data "$models/images" --size 224 --batch-size 64 --workers 8)
    for run in "--scripted $models/resnet18.pt --epochs 2 --precision bf16" "--exported $models/resnet18.pt2 --epochs 2 --precision bf16" \
               "--arch resnet50 --pretrained $models/resnet50.pth --epochs 0"; do
      echo "== image_classifier $run"
      # shellcheck disable=SC2086
      timeout "$(left 120)" "$build/examples/image_classifier" "${folder[@]}" --device cuda:0 $run 2>&1 | grep -v "^\s*$" | tail -6
      echo "exit ${PIPESTATUS[0]}"
    done
    echo "== the same resnet50 weights evaluated on the CPU"
    timeout "$(left 120)" "$build/examples/image_classifier" "${folder[@]}" --device cpu --arch resnet50 \
      --pretrained "$models/resnet50.pth" --epochs 0 2>&1 | tail -2
    common=(--size 224 --batch-size 128 --steps 20 --epochs 2 --mode single --device cuda:0 --precision bf16)
    for ((rep = 1; rep <= reps; rep++)); do
      timeout "$(left 120)" "$build/benchmarks/zoo_vs_pytorch" --exported "$models/resnet18.pt2" "${common[@]}"
      timeout "$(left 120)" "$python" "$repo/benchmarks/zoo_vs_pytorch.py" --arch resnet18 "${common[@]}"
      timeout "$(left 180)" "$python" "$repo/benchmarks/zoo_vs_pytorch.py" --arch resnet18 --compile "${common[@]}"
    done
  } > "$out/models.log" 2>&1
  echo "models exit $?" >> "$out/models.log"
fi

if has rest; then
  # Everything not built yet, until the deadline: every warning the CUDA build of the project gives.
  timeout "$(left 100000)" cmake --build "$build" -j "$(nproc)" -- -k 0 > "$out/rest.log" 2>&1
  echo "rest exit $? after $((SECONDS - started)) s" >> "$out/rest.log"
  grep -c "warning:" "$out/rest.log" >> "$out/rest.log"
fi
