#!/usr/bin/env bash
# Installs what trainloop needs to build, test, document and run its examples on Debian 12:
# Debian's packages, and pip torch 2.11.0 + torchvision 0.26.0 (libtorch 2.11 with CUDA 13 and
# NCCL; the wheels are ~4.7 GB) in a virtual environment outside the checkout, which every clone
# reuses: $TRAINLOOP_VENV, default ~/.cache/trainloop/torch-2.11.0.
#
#   scripts/install-deps.sh                    # both libtorch builds (what scripts/test.sh needs)
#   scripts/install-deps.sh --libtorch pip     # pip torch 2.11 only (plus Debian's build packages)
#   scripts/install-deps.sh --libtorch debian  # Debian's libtorch 1.13 only
#   scripts/install-deps.sh --benchmarks       # the same as without (kept for scripts)
#
# Idempotent and fast when there is nothing to do: apt runs only for missing packages, pip only
# when the environment lacks the pinned torch. Runs apt as root, or through sudo.
set -euo pipefail

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
}

# The pinned pip torch: the GPU machines run 2.11.0+cu130, and PyPI's 2.11.0 wheel is the same
# build (CUDA 13.0, NCCL 2.28). torchvision 0.26 is 2.11's.
torch_version=2.11.0
torchvision_version=0.26.0
# timm: the Python models the torch.export tests export (random init, no hub download).
timm_version=1.0.31
# safetensors: the PyPI reader/writer the safetensors tests compare trainloop's files with.
safetensors_version=0.8.0
venv=${TRAINLOOP_VENV:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/trainloop/torch-$torch_version}

packages=(
  build-essential cmake            # compiler, CMake >= 3.18
  libgloo-dev                      # Gloo's headers: libtorch's c10d headers include them (pip wheels ship none)
  librange-v3-dev zlib1g-dev       # header dependencies of trainloop::trainloop
  nlohmann-json3-dev               # the JSON of torch.export's PT2 archives (interop::ExportedProgram)
  libjpeg62-turbo-dev libpng-dev   # ImageFolder's JPEG and PNG decoding (optional for users)
  libcairo2-dev                    # training-curve plots as PNG (optional for users; SVG without)
  libopenblas0-pthread             # fast BLAS for Debian's libtorch (the reference BLAS is ~13x slower)
  libboost-test-dev                # tests
  clang libclang-rt-14-dev         # libFuzzer + AddressSanitizer: ctest fuzz_weight_files
  libcli11-dev                     # command line of the examples and benchmarks
  dataset-fashion-mnist            # /usr/share/datasets/fashion-mnist, examples and tests
  doxygen                          # API docs (ctest doxygen_no_warnings)
  iproute2                         # `ip` and `ss`: network interfaces and ports of distributed runs
  openmpi-bin                      # mpirun: test_mpirun joins ranks it starts (trainloop does not link MPI)
)
debian_torch_packages=(
  libtorch-dev                     # libtorch 1.13 (CPU) with Gloo
  python3-torch                    # PyTorch 1.13: the reference of 1.13's tests that compare with Python
  python3-torchvision              # (test_python_weights: torchvision's resnet18) and the benchmarks' peer
)
pip_torch_packages=(
  python3-venv                     # the virtual environment pip torch goes into
)
libtorch=both
while [[ $# -gt 0 ]]; do
  case "$1" in
    --benchmarks) ;;
    --libtorch) libtorch=${2:-}; shift ;;
    --libtorch=*) libtorch=${1#--libtorch=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-deps.sh: unknown argument '$1'; expected --libtorch pip|debian|both, --benchmarks or --help" >&2; exit 2 ;;
  esac
  shift
done
case "$libtorch" in
  pip) wanted=("${packages[@]}" "${pip_torch_packages[@]}") ;;
  debian) wanted=("${packages[@]}" "${debian_torch_packages[@]}") ;;
  both) wanted=("${packages[@]}" "${pip_torch_packages[@]}" "${debian_torch_packages[@]}") ;;
  *) echo "install-deps.sh: --libtorch is '$libtorch'; expected pip, debian or both" >&2; exit 2 ;;
esac

missing=()
for p in "${wanted[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$p")
done

install_pip_torch() {
  local python=/usr/bin/python3
  [[ -x $python ]] || python=$(command -v python3)
  if "$venv/bin/python" -c "import torch, torchvision, sys; sys.exit(torch.__version__.split('+')[0] != '$torch_version' or not hasattr(torch.utils, 'cmake_prefix_path'))" 2>/dev/null; then
    echo "install-deps.sh: pip torch $torch_version is in $venv"
    return
  fi
  echo "install-deps.sh: installing pip torch $torch_version and torchvision $torchvision_version into $venv (~4.7 GB)"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$torch_version" "torchvision==$torchvision_version"
  "$venv/bin/python" -c "import torch; print('install-deps.sh: pip torch', torch.__version__, 'CUDA', torch.version.cuda)"
}

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps.sh: all ${#wanted[@]} Debian packages are installed"
else
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
fi
install_safetensors() {
  if "$venv/bin/python" -c "import safetensors, sys; sys.exit(safetensors.__version__ != '$safetensors_version')" 2>/dev/null; then
    return
  fi
  echo "install-deps.sh: installing safetensors $safetensors_version into $venv (the safetensors tests' reference)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "safetensors==$safetensors_version"
}
install_timm() {
  if "$venv/bin/python" -c "import timm, sys; sys.exit(timm.__version__ != '$timm_version')" 2>/dev/null; then
    return
  fi
  echo "install-deps.sh: installing timm $timm_version into $venv (the models the torch.export tests export)"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "timm==$timm_version" "torch==$torch_version" \
    "torchvision==$torchvision_version"
}

if [[ $libtorch != debian ]]; then
  install_pip_torch
  install_timm
  install_safetensors
fi
