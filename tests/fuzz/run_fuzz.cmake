# Run by the ctest test `fuzz_weight_files` as `cmake -D... -P run_fuzz.cmake`: builds
# tests/fuzz/fuzz_weight_files.cpp with clang's libFuzzer and AddressSanitizer against the
# build's libtorch, then fuzzes the safe unpickler for SECONDS from a copy of the seed corpus
# (tests/fuzz/corpus). Fails on any crash, ASan report, leak (but libtorch's own, named in
# lsan_suppressions.txt), input slower than 10 s or RSS over
# 2 GiB (libFuzzer's own exit codes); the input that failed is kept under WORK_DIR/artifacts.
# Without clang++ (or its fuzzer runtime, Debian's libclang-rt-*-dev) it prints
# TRAINLOOP_TEST_SKIPPED and ctest reports Skipped.
#
# Inputs (-D): SOURCE_DIR (tests/fuzz), INCLUDE_DIR (include/), TORCH_DIR, WORK_DIR, SECONDS,
#              CUDA_COMPILER (for a CUDA libtorch's config), PREFIX_PATH ('|'-separated),
#              CCACHE, CCACHE_BASEDIR, CCACHE_MAXSIZE (optional: compile through ccache)
cmake_minimum_required(VERSION 3.18)
find_program(clang NAMES clang++ clang++-16 clang++-15 clang++-14)
if(NOT clang)
  message("TRAINLOOP_TEST_SKIPPED: no clang++ (apt-get install clang libclang-rt-14-dev) for libFuzzer")
  return()
endif()
file(MAKE_DIRECTORY "${WORK_DIR}")
file(WRITE "${WORK_DIR}/probe.cpp" "#include <cstdint>\n#include <cstddef>\nextern \"C\" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return 0; }\n")
execute_process(COMMAND ${clang} -fsanitize=fuzzer,address "${WORK_DIR}/probe.cpp" -o "${WORK_DIR}/probe"
                RESULT_VARIABLE probe_result OUTPUT_QUIET ERROR_QUIET)
if(NOT probe_result EQUAL 0)
  message("TRAINLOOP_TEST_SKIPPED: ${clang} cannot link -fsanitize=fuzzer (apt-get install libclang-rt-14-dev)")
  return()
endif()

# A fresh cache: one left from another libtorch would keep that libtorch's libraries.
file(REMOVE "${WORK_DIR}/build/CMakeCache.txt")
# The prefix path holds ';', which a command line of execute_process would split: a cache file.
string(REPLACE "|" ";" prefix_path "${PREFIX_PATH}")
file(WRITE "${WORK_DIR}/initial-cache.cmake" "set(CMAKE_PREFIX_PATH \"${prefix_path}\" CACHE STRING \"\")\n")
set(configure ${CMAKE_COMMAND} -C "${WORK_DIR}/initial-cache.cmake" -S "${SOURCE_DIR}" -B "${WORK_DIR}/build"
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=${clang} -DTorch_DIR=${TORCH_DIR}
    -DTRAINLOOP_INCLUDE_DIR=${INCLUDE_DIR})
if(CUDA_COMPILER)
  list(APPEND configure -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER})
endif()
# Through ccache when the main build uses it (CCACHE...): a warm CI takes the ~90 s compile from it.
include(${CMAKE_CURRENT_LIST_DIR}/../../cmake/trainloopConsumerCheck.cmake)
trainloop_append_ccache(configure)
foreach(step configure build)
  if(step STREQUAL build)
    set(command ${CMAKE_COMMAND} --build "${WORK_DIR}/build")
  else()
    set(command ${configure})
  endif()
  execute_process(COMMAND ${command} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "fuzz_weight_files: ${step} failed:\n${output}")
  endif()
endforeach()

# A copy: the fuzzer adds what it finds to its corpus directory.
file(REMOVE_RECURSE "${WORK_DIR}/corpus" "${WORK_DIR}/artifacts")
file(COPY "${SOURCE_DIR}/corpus/" DESTINATION "${WORK_DIR}/corpus")
file(MAKE_DIRECTORY "${WORK_DIR}/artifacts")
file(GLOB seeds "${WORK_DIR}/corpus/*")
list(LENGTH seeds seed_count)
message("fuzz_weight_files: ${SECONDS} s from ${seed_count} seeds")
execute_process(COMMAND ${CMAKE_COMMAND} -E env "LSAN_OPTIONS=suppressions=${SOURCE_DIR}/lsan_suppressions.txt"
                        "${WORK_DIR}/build/fuzz_weight_files" -max_total_time=${SECONDS} -rss_limit_mb=2048
                        -timeout=10 -max_len=65536 -print_final_stats=1 -artifact_prefix=${WORK_DIR}/artifacts/
                        "${WORK_DIR}/corpus"
                RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
string(REGEX MATCHALL "stat::[a-z_]+: *[0-9]+" stats "${output}")
string(REGEX MATCH "#[0-9]+[ \t]+DONE[^\n]*" done "${output}")
file(GLOB corpus_after "${WORK_DIR}/corpus/*")
list(LENGTH corpus_after corpus_size)
message("fuzz_weight_files: ${done}; corpus ${seed_count} -> ${corpus_size} inputs; ${stats}")
if(NOT result EQUAL 0)
  string(LENGTH "${output}" length)
  if(length GREATER 6000)
    math(EXPR from "${length} - 6000")
    string(SUBSTRING "${output}" ${from} 6000 output)
  endif()
  message(FATAL_ERROR "fuzz_weight_files: the fuzzer failed (exit ${result}); inputs in ${WORK_DIR}/artifacts:\n${output}")
endif()
