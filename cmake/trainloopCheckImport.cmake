# Run by the ctest test `cmake_import` as `cmake -D... -P trainloopCheckImport.cmake`:
# installs trainloop's build tree into a scratch directory, moves it to a fresh prefix (the
# package must be relocatable), configures tests/cmake_import (a consumer that only says
# find_package(trainloop REQUIRED)) against that prefix, builds it and runs it.
# Fails (FATAL_ERROR) at the first step that does not work, so a broken installed package —
# a missing header, a config that does not find its dependencies, an exported path that points
# into the source or build tree, a lost compile definition — fails the test.
#
# Inputs (-D):
#   TRAINLOOP_BUILD_DIR   the trainloop build tree to install
#   CONSUMER_SOURCE_DIR   tests/cmake_import
#   WORK_DIR              scratch directory (emptied first): <WORK_DIR>/prefix, <WORK_DIR>/build
#   TORCH_PREFIX          where the consumer finds libtorch (the parent of the Torch_DIR used)
#   EXTRA_PREFIX_PATH     the build's own CMAKE_PREFIX_PATH (range-v3 etc. when not in /usr),
#                         '|'-separated (add_test splits ';' lists)
#   GENERATOR, MAKE_PROGRAM, CXX_COMPILER, BUILD_TYPE   reused so the consumer builds alike
#   GLOO_INCLUDE_DIR      where Gloo's headers are (TRAINLOOP_GLOO_INCLUDE_DIR of the build)
#   EXPECT_CUDA           TRUE when the build's libtorch is a CUDA build (USE_C10D_NCCL expected)
#   EXPECT_ABI_FLAG       TRUE when libtorch's TORCH_CXX_FLAGS carry -D_GLIBCXX_USE_CXX11_ABI (1.13; not 2.11)
cmake_minimum_required(VERSION 3.18)

include("${CMAKE_CURRENT_LIST_DIR}/trainloopConsumerCheck.cmake")
trainloop_require_variables(trainloopCheckImport.cmake TRAINLOOP_BUILD_DIR CONSUMER_SOURCE_DIR WORK_DIR)


set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/build")
# Fresh every time: a stale prefix or consumer cache could hide a broken install.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# Installed into one directory and moved to another before use: the package must be relocatable.
set(staging "${WORK_DIR}/staging")
message(STATUS "cmake_import: installing ${TRAINLOOP_BUILD_DIR} into ${staging}, then moving it to ${prefix}")
set(install_command "${CMAKE_COMMAND}" --install "${TRAINLOOP_BUILD_DIR}" --prefix "${staging}")
trainloop_run_step("cmake_import" "cmake --install" install_command)
file(RENAME "${staging}" "${prefix}")

set(config_dir "${prefix}/lib/cmake/trainloop")
foreach(file trainloopConfig.cmake trainloopConfigVersion.cmake trainloopTargets.cmake trainloopDependencies.cmake)
  if(NOT EXISTS "${config_dir}/${file}")
    message(FATAL_ERROR "cmake_import: the install has no ${config_dir}/${file}")
  endif()
endforeach()
if(NOT EXISTS "${prefix}/include/trainloop/trainloop.hpp")
  message(FATAL_ERROR "cmake_import: the install has no include/trainloop/trainloop.hpp")
endif()
# No folder that .gitignore templates and search tools treat as build output (Python.gitignore
# ignores dist/ at any depth: a repository vendoring trainloop would silently lose it).
foreach(build_output_name dist build out target bin obj)
  file(GLOB_RECURSE found LIST_DIRECTORIES true "${prefix}/include/trainloop/*")
  foreach(path IN LISTS found)
    get_filename_component(name "${path}" NAME)
    if(IS_DIRECTORY "${path}" AND name STREQUAL build_output_name)
      message(FATAL_ERROR "cmake_import: the install has a folder named '${name}' (${path}); such names are "
                          "ignored as build output by common .gitignore templates")
    endif()
  endforeach()
endforeach()
# The package must not point back into the source or build tree, nor to where it was installed.
file(READ "${config_dir}/trainloopTargets.cmake" targets_text)
file(READ "${config_dir}/trainloopConfig.cmake" config_text)
string(APPEND targets_text "${config_text}")
get_filename_component(source_dir "${CONSUMER_SOURCE_DIR}/../.." ABSOLUTE)
foreach(forbidden "${source_dir}" "${TRAINLOOP_BUILD_DIR}" "${staging}")
  string(FIND "${targets_text}" "${forbidden}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "cmake_import: the installed package refers to ${forbidden}; "
                        "expected only paths relative to the install prefix")
  endif()
endforeach()

string(REPLACE "|" ";" TORCH_PREFIX "${TORCH_PREFIX}")
string(REPLACE "|" ";" EXTRA_PREFIX_PATH "${EXTRA_PREFIX_PATH}")
set(prefix_path "${prefix}")
if(TORCH_PREFIX)
  list(APPEND prefix_path "${TORCH_PREFIX}")
endif()
if(EXTRA_PREFIX_PATH)
  list(APPEND prefix_path ${EXTRA_PREFIX_PATH})
endif()
# The prefixes travel in the environment variable (':'-separated): a ';' list in a -D argument
# of execute_process would be split into several arguments, and all but the first ignored.
list(JOIN prefix_path ":" prefix_path_env)

set(configure_command "${CMAKE_COMMAND}" -E env "CMAKE_PREFIX_PATH=${prefix_path_env}"
  "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${consumer_build}"
  -DCMAKE_EXPORT_COMPILE_COMMANDS=ON
  # Only the fresh prefix may provide trainloop: no package registry, no stray trainloop_DIR.
  -DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON)
trainloop_append_build_options(configure_command)
if(BUILD_TYPE)
  list(APPEND configure_command "-DCMAKE_BUILD_TYPE=${BUILD_TYPE}")
endif()
message(STATUS "cmake_import: configuring the consumer with CMAKE_PREFIX_PATH=${prefix_path}")
trainloop_run_step("cmake_import" "configuring the consumer" configure_command)

# find_package must have used the package just installed, not another copy.
file(STRINGS "${consumer_build}/CMakeCache.txt" found_dir REGEX "^trainloop_DIR:")
string(REGEX REPLACE "^[^=]*=" "" found_dir "${found_dir}")
get_filename_component(found_dir "${found_dir}" REALPATH)
get_filename_component(expected_dir "${config_dir}" REALPATH)
if(NOT found_dir STREQUAL expected_dir)
  message(FATAL_ERROR "cmake_import: the consumer found trainloop in '${found_dir}'; expected ${expected_dir}")
endif()

message(STATUS "cmake_import: building the consumer")
set(build_command "${CMAKE_COMMAND}" --build "${consumer_build}")
trainloop_run_step("cmake_import" "building the consumer" build_command)

# What the interface must put on the consumer's compile line.
file(READ "${consumer_build}/compile_commands.json" commands)
set(expected -DUSE_C10D_GLOO "${prefix}/include")
if(EXPECT_ABI_FLAG)
  list(APPEND expected -D_GLIBCXX_USE_CXX11_ABI=)
endif()
if(EXPECT_CUDA)
  list(APPEND expected -DUSE_C10D_NCCL -DTRAINLOOP_WITH_CUDA=1)
endif()
foreach(flag IN LISTS expected)
  string(FIND "${commands}" "${flag}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "cmake_import: the consumer's compile command lacks '${flag}':\n${commands}")
  endif()
endforeach()
if(NOT EXPECT_CUDA)
  string(FIND "${commands}" "USE_C10D_NCCL" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "cmake_import: USE_C10D_NCCL defined although libtorch has no CUDA")
  endif()
endif()

set(program "${consumer_build}/trainloop_consumer")
if(NOT EXISTS "${program}")
  # Multi-configuration generators put it in a per-configuration folder.
  file(GLOB_RECURSE program "${consumer_build}/trainloop_consumer" "${consumer_build}/*/trainloop_consumer")
endif()
message(STATUS "cmake_import: running ${program}")
set(run_command "${CMAKE_COMMAND}" -E env "TRAINLOOP_EXPECT_LIBRARIES_UNDER=${EXPECT_LIBRARIES_UNDER}" "${program}")
trainloop_run_step("cmake_import" "running the consumer" run_command)
message(STATUS "cmake_import: the installed package works")
