# Finds trainloop's dependencies and attaches them to a target. Shared by the build tree and by
# the installed package config (installed next to trainloopConfig.cmake), so a consumer gets
# exactly what the tests were built with — decided against the libtorch the *consumer* finds,
# which matters for a header-only library: one installed copy serves a CPU and a CUDA libtorch.
include(CMakeFindDependencyMacro)

# A macro, not a function: inside trainloopConfig.cmake find_dependency() must be able to
# return() from the config file (with trainloop_FOUND false and a message) when a dependency is
# missing, and the variables Torch's config sets (CAFFE2_USE_CUDA, ...) must reach the caller.
macro(trainloop_find_dependencies)
  find_dependency(Threads)
  find_dependency(ZLIB)
  find_dependency(range-v3)
  find_dependency(nlohmann_json 3.2)
  trainloop_prepare_torch_search()
  find_dependency(Torch)
  trainloop_check_torch()
  set(CMAKE_PREFIX_PATH ${_trainloop_saved_prefix_path})
  trainloop_find_optional_dependencies()
endmacro()

# libtorch's TorchConfig.cmake finds its libraries with find_library(... PATHS <its prefix>/lib),
# which CMake searches only after the system's library directories: on a machine that also has
# Debian's libtorch-dev, pip torch's config took /usr/lib's libtorch.so (seen here: 2.11's
# headers with 1.13's library). Putting the config's own prefix first in CMAKE_PREFIX_PATH (for
# the find_package(Torch) call only; the caller restores it from _trainloop_saved_prefix_path)
# makes it find its own. A CUDA libtorch without a CUDA toolkit stops here, saying so, instead
# of deep inside Caffe2's cuda.cmake.
macro(trainloop_prepare_torch_search)
  set(_trainloop_saved_prefix_path ${CMAKE_PREFIX_PATH})
  find_path(TRAINLOOP_TORCH_CONFIG_DIR TorchConfig.cmake HINTS ${Torch_DIR}
            PATH_SUFFIXES Torch share/cmake/Torch lib/cmake/Torch lib/${CMAKE_LIBRARY_ARCHITECTURE}/cmake/Torch
            DOC "The folder of the TorchConfig.cmake that trainloop's checks of libtorch looked at")
  if(TRAINLOOP_TORCH_CONFIG_DIR)
    get_filename_component(_trainloop_torch_root "${TRAINLOOP_TORCH_CONFIG_DIR}/../../.." ABSOLUTE)
    if(EXISTS "${_trainloop_torch_root}/lib/libtorch_cpu.so")  # pip's and the libtorch zip's layout
      list(PREPEND CMAKE_PREFIX_PATH "${_trainloop_torch_root}")
      if(EXISTS "${_trainloop_torch_root}/lib/libtorch_cuda.so" AND NOT CMAKE_CUDA_COMPILER)
        find_program(TRAINLOOP_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin PATHS /usr/local/cuda/bin)
        if(TRAINLOOP_NVCC AND NOT DEFINED ENV{CUDACXX})
          set(ENV{CUDACXX} "${TRAINLOOP_NVCC}")  # Caffe2's config enables CUDA: the same nvcc, also off PATH
        elseif(NOT TRAINLOOP_NVCC)
          message(FATAL_ERROR "trainloop: the libtorch at ${_trainloop_torch_root} is a CUDA build "
                  "(lib/libtorch_cuda.so) and its CMake config needs the CUDA toolkit, but no nvcc was found (PATH, "
                  "$CUDA_HOME, /usr/local/cuda); expected the CUDA toolkit it was built with "
                  "(-DCMAKE_CUDA_COMPILER=/path/to/nvcc), or a CPU-only libtorch")
        endif()
      endif()
    endif()
  endif()
endmacro()

# The libtorch releases trainloop is built and tested against: the newest (what `pip install
# torch` gives, primary) back to the oldest that CI still runs (docs/status.md says what ran on
# each). Older ones lack what trainloop uses (torch.export's schema 8.x, DCP's layout, Gloo's
# reduce-scatter); a newer one is refused until it has been tried, since libtorch's C++ API
# changes between minor releases (2.15 made autograd nodes intrusive pointers), unless
# TRAINLOOP_ALLOW_UNTESTED_TORCH says to try it anyway.
set(TRAINLOOP_TORCH_OLDEST 2.11)
set(TRAINLOOP_TORCH_NEWEST 2.15)
option(TRAINLOOP_ALLOW_UNTESTED_TORCH "Configure against a libtorch newer than the newest trainloop was tested with" OFF)

# FATAL_ERROR naming `version` and the supported range when it is outside it.
function(trainloop_check_torch_version version)
  if(NOT version)
    message(FATAL_ERROR "trainloop: the libtorch found (${Torch_DIR}) does not say its version (no Torch_VERSION, no "
            "torch/version.h); expected libtorch ${TRAINLOOP_TORCH_OLDEST} to ${TRAINLOOP_TORCH_NEWEST}")
  endif()
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" major_minor "${version}")
  string(CONCAT install_hint "install a supported one, e.g. `python3 -m venv venv && venv/bin/pip install torch==2.15.0`, "
         "and pass -DCMAKE_PREFIX_PATH=$(venv/bin/python -c 'import torch;print(torch.utils.cmake_prefix_path)') "
         "(trainloop's scripts/install-deps.sh does this), or unpack the libtorch ${TRAINLOOP_TORCH_NEWEST} download")
  if(major_minor VERSION_LESS TRAINLOOP_TORCH_OLDEST)
    message(FATAL_ERROR "trainloop: libtorch ${version} was found (${Torch_DIR}); expected libtorch "
            "${TRAINLOOP_TORCH_OLDEST} to ${TRAINLOOP_TORCH_NEWEST}; ${install_hint}.")
  endif()
  if(major_minor VERSION_GREATER TRAINLOOP_TORCH_NEWEST AND NOT TRAINLOOP_ALLOW_UNTESTED_TORCH)
    message(FATAL_ERROR "trainloop: libtorch ${version} was found (${Torch_DIR}); expected libtorch "
            "${TRAINLOOP_TORCH_OLDEST} to ${TRAINLOOP_TORCH_NEWEST}, the releases this trainloop was tested with. "
            "${install_hint}; or try this one with -DTRAINLOOP_ALLOW_UNTESTED_TORCH=ON.")
  endif()
endfunction()

# After find_package(Torch): a libtorch trainloop supports (trainloop_check_torch_version), whose libraries are
# its own (see trainloop_prepare_torch_search), else a configure error naming what was found.
function(trainloop_check_torch)
  set(version "${Torch_VERSION}")
  if(NOT version)
    find_file(TRAINLOOP_TORCH_VERSION_HEADER torch/version.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
    set(version_header "${TRAINLOOP_TORCH_VERSION_HEADER}")
    unset(TRAINLOOP_TORCH_VERSION_HEADER CACHE)  # another libtorch in this build tree finds its own
    if(version_header)
      file(STRINGS "${version_header}" lines REGEX "#define TORCH_VERSION_(MAJOR|MINOR) ")
      string(REGEX MATCH "MAJOR ([0-9]+)" _ "${lines}")
      set(major "${CMAKE_MATCH_1}")
      string(REGEX MATCH "MINOR ([0-9]+)" _ "${lines}")
      set(version "${major}.${CMAKE_MATCH_1}")
    endif()
  endif()
  trainloop_check_torch_version("${version}")
  if(TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cpu.so")
    get_filename_component(own_dir "${TORCH_INSTALL_PREFIX}/lib" REALPATH)
    foreach(library_variable TORCH_LIBRARY C10_LIBRARY TORCH_CPU_LIBRARY C10_CUDA_LIBRARY)
      if(NOT ${library_variable})
        continue()
      endif()
      get_filename_component(found_dir "${${library_variable}}" DIRECTORY)
      get_filename_component(found_dir "${found_dir}" REALPATH)
      if(NOT found_dir STREQUAL own_dir)
        message(FATAL_ERROR "trainloop: the libtorch config at ${Torch_DIR} (libtorch ${version}) took "
                "${library_variable} from ${${library_variable}}, another libtorch's; expected it in ${own_dir}. Add "
                "${TORCH_INSTALL_PREFIX} to CMAKE_PREFIX_PATH, or clear ${library_variable} from the cache")
      endif()
    endforeach()
  endif()
  set(TRAINLOOP_TORCH_VERSION "${version}" PARENT_SCOPE)
endfunction()

# Optional: JPEG and PNG decoding (ImageFolder), cairo (training-curve plots as PNG). Without
# one, that feature reports at run time what to install (see data/image_decode.hpp, plots).
macro(trainloop_find_optional_dependencies)
  find_package(JPEG QUIET)
  find_package(PNG QUIET)
  find_package(PkgConfig QUIET)
  if(PkgConfig_FOUND AND NOT TARGET PkgConfig::TRAINLOOP_CAIRO)
    pkg_check_modules(TRAINLOOP_CAIRO QUIET IMPORTED_TARGET cairo)
  endif()
endmacro()

# Whether the libtorch found is a CUDA build. TorchConfig.cmake sets TORCH_CUDA_LIBRARIES (and
# Caffe2Config.cmake sets CAFFE2_USE_CUDA) only in CUDA builds; the torch_cuda target is the
# CUDA half of libtorch. Anything else (CUDA_FOUND, a CUDA toolkit on the machine) says nothing
# about libtorch: Debian's CPU-only libtorch coexists with /usr/local/cuda here.
function(trainloop_torch_has_cuda out_var)
  if(CAFFE2_USE_CUDA OR TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
    set(${out_var} TRUE PARENT_SCOPE)
  else()
    set(${out_var} FALSE PARENT_SCOPE)
  endif()
endfunction()

# The library folders of the `nvidia-*` wheels that a pip torch wheel was built with and loads
# (site-packages/nvidia/<name>/lib: nccl, cu13, cudnn, cusparselt, nvshmem), in `out_var`; empty
# for a libtorch that is not a wheel. libtorch_cuda.so finds them at run time through its own
# RPATH ($ORIGIN/../../nvidia/...), but the linker checks its undefined symbols against the
# first libnccl.so.2 it meets: with a CUDA toolkit on the machine that is the toolkit's, on the
# -rpath CMake adds for CUDA::cudart. torch 2.15's libtorch_cuda.so needs ncclCommGrow,
# ncclCommSuspend, ncclWaitSignal ..., which the CUDA 13.0 toolkit's NCCL lacks, and the link
# failed. A program's own RUNPATH decides the libraries it needs itself (libcudart.so.13, linked
# from the toolkit's CUDA::cudart): the wheel's folders first there too, so one process never mixes
# the toolkit's runtime with the wheel's. `-rpath-link` serves the link, `-rpath` the run.
function(trainloop_wheel_library_dirs out_var)
  set(dirs "")
  if(TORCH_INSTALL_PREFIX AND EXISTS "${TORCH_INSTALL_PREFIX}/lib/libtorch_cpu.so")
    get_filename_component(site_packages "${TORCH_INSTALL_PREFIX}/.." ABSOLUTE)
    file(GLOB candidates LIST_DIRECTORIES true "${site_packages}/nvidia/*/lib")
    list(SORT candidates)
    # NCCL first: the library whose version matters most (the toolkit's is older).
    foreach(dir IN LISTS candidates)
      if(IS_DIRECTORY "${dir}")
        if(dir MATCHES "/nvidia/nccl/lib$")
          list(PREPEND dirs "${dir}")
        else()
          list(APPEND dirs "${dir}")
        endif()
      endif()
    endforeach()
  endif()
  set(${out_var} "${dirs}" PARENT_SCOPE)
endfunction()

# The link options that put trainloop_wheel_library_dirs() first for the link and the run, in
# `out_var` (empty for a libtorch that is not a wheel).
function(trainloop_wheel_link_options out_var)
  trainloop_wheel_library_dirs(dirs)
  set(options "")
  if(dirs)
    list(JOIN dirs ":" joined)
    set(options "LINKER:-rpath-link,${joined}" "LINKER:-rpath,${joined}")
  endif()
  set(${out_var} "${options}" PARENT_SCOPE)
endfunction()

# Gloo's headers: ProcessGroupGloo.hpp includes <gloo/...>. Debian's libgloo-dev installs them;
# pip torch wheels compile Gloo in but ship none of its headers (checked: torch 2.11.0+cu130), so
# a consumer of pip torch points TRAINLOOP_GLOO_INCLUDE_DIR at a copy (the API trainloop uses,
# createDeviceFor*() and the backend options, is the same in Debian's Gloo; headers from the Gloo
# commit the wheel was built from are the safer choice). Sets `found_var` TRUE or FALSE.
set(TRAINLOOP_GLOO_NOT_FOUND_MESSAGE
    "trainloop: Gloo's headers (gloo/algorithm.h) were not found; libtorch's c10d headers include them. Install "
    "them (Debian: libgloo-dev) or pass -DTRAINLOOP_GLOO_INCLUDE_DIR=<directory holding gloo/>; pip torch wheels "
    "ship none.")
function(trainloop_find_gloo_headers found_var)
  find_path(TRAINLOOP_GLOO_INCLUDE_DIR gloo/algorithm.h HINTS ${TORCH_INCLUDE_DIRS}
            DOC "Directory holding gloo/algorithm.h (Gloo's headers)")
  if(TRAINLOOP_GLOO_INCLUDE_DIR)
    set(${found_var} TRUE PARENT_SCOPE)
  else()
    set(${found_var} FALSE PARENT_SCOPE)
  endif()
endfunction()

# Attaches libtorch, range-v3, nlohmann-json (the JSON of PT2 archives), zlib, threads and the
# c10d definitions to `target`.
#
# On trainloop's own (non-imported) target everything is wrapped in $<BUILD_INTERFACE:...>:
# ${TORCH_LIBRARIES} holds absolute paths (libc10.so, CUDA libraries) that must not be frozen
# into the exported trainloopTargets.cmake. The installed config calls this function again on
# the imported trainloop::trainloop after re-finding Torch, so the installed interface is
# rebuilt from the consumer's libtorch and stays relocatable. TORCH_CXX_FLAGS
# (-D_GLIBCXX_USE_CXX11_ABI=...) reaches consumers as the `torch` target's
# INTERFACE_COMPILE_OPTIONS.
function(trainloop_link_dependencies target)
  get_target_property(imported ${target} IMPORTED)
  set(libraries ${TORCH_LIBRARIES} range-v3::range-v3 nlohmann_json::nlohmann_json ZLIB::ZLIB Threads::Threads)
  set(include_dirs "")
  # libstdc++ first among the program's libraries. pip torch's libtorch_cpu.so exports copies of
  # libstdc++'s std::filesystem functions, linked into it statically (pytorch issue 133437). A
  # program whose DT_NEEDED lists libtorch before libstdc++ (the compiler driver adds -lstdc++
  # last) binds std::filesystem::remove_all to libtorch's copy, which called a null pointer
  # on the GPU machine (torch 2.11.0+cu130: every remove_all crashed). Naming libstdc++ before
  # libtorch makes the dynamic linker find libstdc++'s own definitions first.
  if(UNIX AND NOT APPLE AND NOT CMAKE_CXX_FLAGS MATCHES "-stdlib=libc\\+\\+")
    list(PREPEND libraries stdc++)
  endif()
  # TorchConfig.cmake defines neither c10d backend macro, yet ProcessGroupGloo.hpp and
  # ProcessGroupNCCL.hpp are empty without them.
  set(definitions USE_C10D_GLOO)
  trainloop_torch_has_cuda(has_cuda)
  if(has_cuda)
    list(APPEND definitions USE_C10D_NCCL TRAINLOOP_WITH_CUDA=1)
  endif()
  if(TARGET JPEG::JPEG)
    list(APPEND libraries JPEG::JPEG)
    list(APPEND definitions TRAINLOOP_WITH_JPEG=1)
  endif()
  if(TARGET PNG::PNG)
    list(APPEND libraries PNG::PNG)
    list(APPEND definitions TRAINLOOP_WITH_PNG=1)
  endif()
  if(TARGET PkgConfig::TRAINLOOP_CAIRO)
    list(APPEND libraries PkgConfig::TRAINLOOP_CAIRO)
    list(APPEND definitions TRAINLOOP_WITH_CAIRO=1)
  endif()

  # The wheel's own CUDA libraries (NCCL, cuDNN, cuBLAS, the CUDA runtime) before any other copy.
  trainloop_wheel_link_options(link_options)

  trainloop_find_gloo_headers(gloo_found)
  if(NOT gloo_found)
    message(FATAL_ERROR "${TRAINLOOP_GLOO_NOT_FOUND_MESSAGE}")
  endif()
  list(APPEND include_dirs "${TRAINLOOP_GLOO_INCLUDE_DIR}")

  if(imported)
    # find_package(trainloop) twice in one directory re-includes the config; attach once.
    get_target_property(existing ${target} INTERFACE_COMPILE_DEFINITIONS)
    if(existing AND "USE_C10D_GLOO" IN_LIST existing)
      return()
    endif()
  else()
    list(TRANSFORM libraries REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
    list(TRANSFORM definitions REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
    list(TRANSFORM include_dirs REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
    list(TRANSFORM link_options REPLACE "^(.+)$" "$<BUILD_INTERFACE:\\1>")
  endif()
  target_link_libraries(${target} INTERFACE ${libraries})
  if(link_options)
    target_link_options(${target} INTERFACE ${link_options})
  endif()
  target_compile_definitions(${target} INTERFACE ${definitions})
  target_include_directories(${target} SYSTEM INTERFACE ${include_dirs})
endfunction()

# Makes every imported target trainloop links (libtorch's, range-v3's, zlib's, and what they
# link in turn) visible in all directories (IMPORTED_GLOBAL). Needed when trainloop is a
# subdirectory of another project (add_subdirectory, FetchContent): imported targets are
# otherwise visible only in the directory whose find_package() created them, i.e. trainloop's,
# while the targets linking trainloop::trainloop live in the parent. Must run in the directory
# that called find_package().
function(trainloop_make_dependencies_global)
  if(NOT CMAKE_VERSION VERSION_LESS 3.21)
    # The imported targets trainloop's own find_package() calls created (libtorch's config
    # creates more than trainloop names: torch_cpu, c10, caffe2::*, CUDA::*), not those a parent
    # project created: those are visible already, and promoting theirs is not ours to do.
    set(imported ${TRAINLOOP_CREATED_IMPORTED_TARGETS})
  else()
    # Best effort without the IMPORTED_TARGETS directory property: the names trainloop links.
    set(imported torch torch_cpu torch_cuda c10 c10_cuda torch_library range-v3::range-v3 range-v3
        nlohmann_json::nlohmann_json ZLIB::ZLIB
        Threads::Threads)
  endif()
  foreach(target IN LISTS imported)
    if(NOT TARGET "${target}")
      continue()
    endif()
    get_target_property(aliased "${target}" ALIASED_TARGET)
    get_target_property(global "${target}" IMPORTED_GLOBAL)
    if(NOT aliased AND NOT global)
      set_target_properties("${target}" PROPERTIES IMPORTED_GLOBAL TRUE)
    endif()
  endforeach()
endfunction()

# In trainloop's own build a missing dependency is a configure error. (In the installed config
# the macro above runs instead, so find_package(trainloop) reports it the standard way.)
if(NOT TRAINLOOP_LOADING_PACKAGE_CONFIG)
  if(NOT CMAKE_VERSION VERSION_LESS 3.21)
    get_directory_property(trainloop_imported_before IMPORTED_TARGETS)
  endif()
  find_package(Threads REQUIRED)
  find_package(ZLIB REQUIRED)
  find_package(range-v3 REQUIRED)
  find_package(nlohmann_json 3.2 REQUIRED)
  # A parent project that found Torch already: its targets are visible here, and a second
  # find_package(Torch) would fail with a CUDA libtorch (Caffe2's cuda.cmake creates
  # caffe2::cuda and friends without checking whether they exist).
  if(NOT TARGET torch)
    trainloop_prepare_torch_search()
    find_package(Torch REQUIRED)
    trainloop_check_torch()
    set(CMAKE_PREFIX_PATH ${_trainloop_saved_prefix_path})
    message(STATUS "trainloop: libtorch ${TRAINLOOP_TORCH_VERSION} from ${Torch_DIR}")
  endif()
  trainloop_find_optional_dependencies()
  message(STATUS "trainloop: JPEG ${JPEG_FOUND}, PNG ${PNG_FOUND}, cairo ${TRAINLOOP_CAIRO_FOUND} (optional)")
  if(NOT CMAKE_VERSION VERSION_LESS 3.21)
    get_directory_property(trainloop_imported_after IMPORTED_TARGETS)
    set(TRAINLOOP_CREATED_IMPORTED_TARGETS ${trainloop_imported_after})
    if(trainloop_imported_before)
      list(REMOVE_ITEM TRAINLOOP_CREATED_IMPORTED_TARGETS ${trainloop_imported_before})
    endif()
  endif()
endif()
