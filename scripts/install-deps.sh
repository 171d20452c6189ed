#!/usr/bin/env bash
# Installs what trainloop needs to build, test, document and run its examples on Debian 12.
#
#   scripts/install-deps.sh               # build + test + docs + example dependencies
#   scripts/install-deps.sh --benchmarks  # the same (kept for scripts; python3-torch is now a test dependency)
#
# Idempotent and fast when there is nothing to do: when every package is already installed it
# runs neither `apt-get update` nor `apt-get install`. Runs apt as root, or through sudo.
set -euo pipefail

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
}

packages=(
  build-essential cmake            # compiler, CMake >= 3.18
  libtorch-dev libgloo-dev         # libtorch 1.13 (CPU) and its Gloo backend headers
  librange-v3-dev zlib1g-dev       # header dependencies of trainloop::trainloop
  libjpeg62-turbo-dev libpng-dev   # ImageFolder's JPEG and PNG decoding (optional for users)
  libcairo2-dev                    # training-curve plots as PNG (optional for users; SVG without)
  libopenblas0-pthread             # fast BLAS for libtorch (the reference BLAS is ~13x slower)
  libboost-test-dev                # tests
  clang libclang-rt-14-dev         # libFuzzer + AddressSanitizer: ctest fuzz_weight_files
  libcli11-dev                     # command line of the examples and benchmarks
  dataset-fashion-mnist            # /usr/share/datasets/fashion-mnist, examples and tests
  doxygen                          # API docs (ctest doxygen_no_warnings)
  iproute2                         # `ip` and `ss`: network interfaces and ports of distributed runs
  openmpi-bin                      # mpirun: test_mpirun joins ranks it starts (trainloop does not link MPI)
  python3-torch                    # PyTorch 1.13: the reference of the tests that compare with Python
  python3-torchvision              # (test_python_weights: torchvision's resnet18) and the benchmarks' peer
)
benchmark_packages=(
)

want_benchmarks=0
for arg in "$@"; do
  case "$arg" in
    --benchmarks) want_benchmarks=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-deps.sh: unknown argument '$arg'; expected --benchmarks or --help" >&2; exit 2 ;;
  esac
done

wanted=("${packages[@]}")
if [[ $want_benchmarks == 1 ]]; then
  wanted+=("${benchmark_packages[@]}")
fi

missing=()
for p in "${wanted[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps.sh: all ${#wanted[@]} packages are installed"
  exit 0
fi

if [[ $(id -u) -eq 0 ]]; then
  as_root=()
elif command -v sudo > /dev/null; then
  as_root=(sudo)
else
  echo "install-deps.sh: missing packages (${missing[*]}) and neither root nor sudo to install them" >&2
  exit 1
fi

echo "install-deps.sh: installing ${missing[*]}"
"${as_root[@]}" apt-get update -q
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
