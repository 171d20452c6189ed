#!/usr/bin/env bash
# Installs what trainloop needs to build, test, document and run its examples on Debian 12:
# Debian's packages, and pip torch (the libtorch inside it: CUDA 13 and NCCL, ~4.7 GB with its
# nvidia-* wheels) in a virtual environment outside the checkout, one per torch release, which
# every clone reuses: ~/.cache/trainloop/torch-<version> (scripts/libtorch-env.sh).
#
#   scripts/install-deps.sh                    # Debian's packages + pip torch 2.15.0 (the primary libtorch)
#   scripts/install-deps.sh --torch 2.11.0     # ... + pip torch 2.11.0 (repeatable: --torch 2.12.1 --torch 2.13.0)
#   scripts/install-deps.sh --benchmarks       # the same as without (kept for scripts)
#
# Supported torch releases: 2.11.0 to 2.15.0. Idempotent and fast when there is nothing to do:
# apt runs only for missing packages, pip only when a venv lacks its pinned torch. Runs apt as
# root, or through sudo.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=scripts/libtorch-env.sh
source "$repo/scripts/libtorch-env.sh"

usage() {
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
}

# torchvision for each supported torch (PyPI's pairing; 0.29.2 requires torch >= 2.14 and is the
# newest torchvision on PyPI, so 2.15 uses it too: checked, it imports and builds resnet18 there).
torchvision_for() {
  case "$1" in
    2.11.*) echo 0.26.0 ;;
    2.12.*) echo 0.27.1 ;;
    2.13.*) echo 0.28.0 ;;
    2.14.* | 2.15.*) echo 0.29.2 ;;
    *) echo "install-deps.sh: torch $1 is outside the supported range $trainloop_torch_oldest to $trainloop_torch_primary" >&2
       return 1 ;;
  esac
}
# timm: the Python models the torch.export tests export (random init, no hub download).
timm_version=1.0.31
# safetensors: the PyPI reader/writer the safetensors tests compare trainloop's files with.
safetensors_version=0.8.0

packages=(
  build-essential cmake ninja-build # compiler, CMake >= 3.18, Ninja (the scripts' generator)
  ccache                           # compiler cache: a later build of the same sources (CI after a session) reuses objects
  libgloo-dev                      # Gloo's headers: libtorch's c10d headers include them (pip wheels ship none)
  librange-v3-dev zlib1g-dev       # header dependencies of trainloop::trainloop
  nlohmann-json3-dev               # the JSON of torch.export's PT2 archives (interop::ExportedProgram)
  libjpeg62-turbo-dev libpng-dev   # ImageFolder's JPEG and PNG decoding (optional for users)
  libcairo2-dev                    # training-curve plots as PNG (optional for users; SVG without)
  libboost-test-dev                # tests
  clang libclang-rt-14-dev         # libFuzzer + AddressSanitizer: ctest fuzz_weight_files
  libcli11-dev                     # command line of the examples and benchmarks
  dataset-fashion-mnist            # /usr/share/datasets/fashion-mnist, examples and tests
  doxygen                          # API docs (ctest doxygen_no_warnings)
  iproute2                         # `ip` and `ss`: network interfaces and ports of distributed runs
  openmpi-bin                      # mpirun: test_mpirun joins ranks it starts (trainloop does not link MPI)
  python3-venv                     # the virtual environments pip torch goes into
)
versions=("$trainloop_torch_primary")
while [[ $# -gt 0 ]]; do
  case "$1" in
    --benchmarks) ;;
    --torch) versions+=("${2:?--torch needs a version, e.g. --torch 2.11.0}"); shift ;;
    --torch=*) versions+=("${1#--torch=}") ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-deps.sh: unknown argument '$1'; expected --torch VERSION, --benchmarks or --help" >&2; exit 2 ;;
  esac
  shift
done
mapfile -t versions < <(printf '%s\n' "${versions[@]}" | awk '!seen[$0]++')  # each release once
for version in "${versions[@]}"; do torchvision_for "$version" > /dev/null || exit 2; done

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null || true)
  [[ $status == installed ]] || missing+=("$p")
done
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps.sh: all ${#packages[@]} Debian packages are installed"
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

# pip torch $1 with its torchvision, timm and safetensors, in its own venv.
install_pip_torch() {
  local version=$1 torchvision venv python=/usr/bin/python3
  torchvision=$(torchvision_for "$version")
  venv=$(trainloop_venv_of "$version")
  [[ -x $python ]] || python=$(command -v python3)
  if "$venv/bin/python" - "$version" "$torchvision" "$timm_version" "$safetensors_version" 2> /dev/null <<'EOF'
import sys, torch, torchvision, timm, safetensors
want = sys.argv[1:]
have = [m.__version__.split('+')[0] for m in (torch, torchvision, timm, safetensors)]
sys.exit(have != want or not hasattr(torch.utils, 'cmake_prefix_path'))
EOF
  then
    echo "install-deps.sh: pip torch $version is in $venv"
    return
  fi
  echo "install-deps.sh: installing pip torch $version, torchvision $torchvision, timm $timm_version and safetensors $safetensors_version into $venv (~4.7 GB)"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  # numpy: torch warns on import without it, and the Python references use it.
  "$venv/bin/pip" install --quiet --disable-pip-version-check "torch==$version" "torchvision==$torchvision" \
    "timm==$timm_version" "safetensors==$safetensors_version" numpy
  "$venv/bin/python" -c "import torch; print('install-deps.sh: pip torch', torch.__version__, 'CUDA', torch.version.cuda)"
}
for version in "${versions[@]}"; do install_pip_torch "$version"; done
