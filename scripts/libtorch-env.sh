# Sourced by scripts/install-deps.sh, scripts/train-example.sh and scripts/test.sh: which libtorch
# a build uses.
#
#   trainloop_libtorch             # the primary libtorch: pip torch 2.15.0 in its venv
#   trainloop_libtorch 2.11.0      # another supported release, in its own venv
#
# Every libtorch is the one inside a pip `torch` wheel, installed by scripts/install-deps.sh into
# a virtual environment outside the checkout, one per release:
# $TRAINLOOP_VENV_ROOT/torch-<version> (default ~/.cache/trainloop/torch-<version>), which every
# clone reuses. TRAINLOOP_VENV names one venv directly (a torch you installed yourself).
#
# Sets: libtorch_cmake_args (CMAKE_PREFIX_PATH for CMake), libtorch_python (the Python torch of the
# same libtorch: the reference of the tests that compare with Python, and torchrun's),
# libtorch_version and libtorch_describe (for messages). Puts the venv's bin (torchrun) first on PATH.

# The primary release (what `pip install torch` gives in November 2026) and the oldest one
# trainloop supports; cmake/trainloopDependencies.cmake refuses anything outside them.
trainloop_torch_primary=2.15.0
trainloop_torch_oldest=2.11.0
trainloop_venv_root=${TRAINLOOP_VENV_ROOT:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/trainloop}

# The venv of torch release $1.
trainloop_venv_of() {
  if [[ -n ${TRAINLOOP_VENV:-} ]]; then
    echo "$TRAINLOOP_VENV"
  else
    echo "$trainloop_venv_root/torch-$1"
  fi
}

trainloop_libtorch() {
  local version=${1:-$trainloop_torch_primary}
  local venv
  venv=$(trainloop_venv_of "$version")
  libtorch_python="$venv/bin/python"
  local prefix
  # Only stdout is the answer: Python's warnings (a venv without numpy prints a UserWarning on
  # `import torch`) go to stderr, which must not end up in CMAKE_PREFIX_PATH.
  if ! prefix=$("$libtorch_python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || [[ -z $prefix ]]; then
    echo "trainloop: $venv has no pip torch that says where its libtorch is (torch.utils.cmake_prefix_path); expected pip torch $version there (scripts/install-deps.sh --torch $version)" >&2
    return 1
  fi
  # The torch package folder too: its CMake config then finds its own libraries before any
  # other libtorch on the machine (cmake/trainloopDependencies.cmake says why).
  libtorch_cmake_args=("-DCMAKE_PREFIX_PATH=$prefix;$(dirname "$(dirname "$prefix")")")
  libtorch_version=$("$libtorch_python" -c 'import torch; print(torch.__version__)' 2>/dev/null)
  libtorch_describe="pip torch $libtorch_version ($venv)"
  export PATH="$venv/bin:$PATH"
  export TRAINLOOP_PYTHON="$libtorch_python"
}

# The build folder of torch release $1: build/ for the primary one, build-torch-<version>/ for others.
trainloop_build_dir_of() {
  if [[ $1 == "$trainloop_torch_primary" ]]; then
    echo "${BUILD_DIR:-$repo/build}"
  else
    echo "$repo/build-torch-$1"
  fi
}
