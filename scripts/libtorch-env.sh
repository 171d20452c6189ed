# Sourced by scripts/train-example.sh and scripts/test.sh: the libtorch a build uses.
#
#   trainloop_libtorch pip      # pip torch 2.11 in $TRAINLOOP_VENV (scripts/install-deps.sh puts it there)
#   trainloop_libtorch debian   # Debian's libtorch-dev 1.13
#
# Sets: libtorch_cmake_args (CMAKE_PREFIX_PATH for CMake), libtorch_python (the Python torch of the
# same libtorch: the reference of the tests that compare with Python, and torchrun's), and
# libtorch_describe (for messages). Puts the venv's bin (torchrun) first on PATH for pip.

trainloop_venv=${TRAINLOOP_VENV:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/trainloop/torch-2.11.0}

# The libtorch a command uses when none is named: pip torch 2.11, whose CMake config needs the
# CUDA toolkit (its wheel is a CUDA build; this project's machines have CUDA 13 in /usr/local/cuda),
# or, on a machine without nvcc, Debian's 1.13, said loudly.
trainloop_default_libtorch() {
  if command -v nvcc > /dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || [[ -n ${CUDA_HOME:-} && -x $CUDA_HOME/bin/nvcc ]]; then
    echo pip
  else
    echo "trainloop: no CUDA toolkit (nvcc) here, which pip torch's CMake config needs; using Debian's libtorch 1.13 (install the CUDA toolkit for the 2.11 build)" >&2
    echo debian
  fi
}

trainloop_libtorch() {
  case "$1" in
    pip)
      libtorch_python="$trainloop_venv/bin/python"
      local prefix
      if ! prefix=$("$libtorch_python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>&1); then
        echo "trainloop: pip torch in $trainloop_venv does not say where its libtorch is (torch.utils.cmake_prefix_path): $prefix; expected pip torch >= 1.13 there (scripts/install-deps.sh --libtorch pip)" >&2
        return 1
      fi
      # The torch package folder too: its CMake config then finds its own libraries before any
      # other libtorch on the machine (cmake/trainloopDependencies.cmake says why).
      libtorch_cmake_args=("-DCMAKE_PREFIX_PATH=$prefix;$(dirname "$(dirname "$prefix")")")
      libtorch_describe="pip torch $("$libtorch_python" -c 'import torch; print(torch.__version__)') ($trainloop_venv)"
      export PATH="$trainloop_venv/bin:$PATH"
      ;;
    debian)
      libtorch_python=/usr/bin/python3
      libtorch_cmake_args=()
      libtorch_describe="Debian's libtorch 1.13 (libtorch-dev)"
      ;;
    *)
      echo "trainloop: --libtorch is '$1'; expected pip (torch 2.11 from PyPI) or debian (libtorch-dev 1.13)" >&2
      return 1
      ;;
  esac
  export TRAINLOOP_PYTHON="$libtorch_python"
}
