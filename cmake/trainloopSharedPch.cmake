# One precompiled header for every program of trainloop's own build: tests, their worker
# programs, examples, benchmarks, the docs' snippets and the compile-fail tests.
#
# Why: with only <torch/torch.h> precompiled, a test's source still spent ~40 s of its compile
# parsing <trainloop/trainloop.hpp> and the c10d, CUDA and JSON headers it includes (measured on
# the 2-core AMD EPYC, torch 2.15, GCC 12: `#include <trainloop/trainloop.hpp>` alone, with
# -fsyntax-only, 40.2 s; test_train_loop.cpp 47.5 s -fsyntax-only, 172 s at -O3). Over ~70
# programs that parse was half of CI's build. Now it is parsed once, here.
#
# GCC uses a PCH only when the macros it was built with are defined alike where it is used and
# the compile options match, so every user links what the PCH target links (trainloop::trainloop
# and trainloop_warnings) and gets Boost.Test's definitions (nothing of Boost is in the PCH); a
# mismatch is a -Winvalid-pch warning, which -Werror turns into an error rather than a silent
# slow build.
#
# What the PCH holds is visible to every source, so a program's missing include of a public
# header would go unnoticed here: the header check (tests/CMakeLists.txt, TRAINLOOP_HEADER_CHECK)
# compiles each header on its own with only <torch/torch.h> precompiled, and the consumer tests
# (cmake_import, cmake_subdirectory, cmake_fetchcontent) build without any PCH.
option(TRAINLOOP_SHARED_PCH "Share one precompiled <torch/torch.h> + <trainloop/trainloop.hpp> between trainloop's own programs" ON)

# Boost.Test: the compiled library when installed (Debian's libboost-test-dev), else its
# header-only form (tests/unit_test.hpp switches), so the suite also builds on machines that
# only carry Boost's headers (the GPU machines: scripts/gpu-check.sh).
macro(trainloop_find_boost_test)
  if(POLICY CMP0167)
    cmake_policy(SET CMP0167 NEW)  # Boost's own BoostConfig.cmake, not CMake's FindBoost
  endif()
  find_package(Boost QUIET COMPONENTS unit_test_framework)
  add_library(trainloop_boost_test INTERFACE)
  if(TARGET Boost::unit_test_framework)
    target_link_libraries(trainloop_boost_test INTERFACE Boost::unit_test_framework)
    target_compile_definitions(trainloop_boost_test INTERFACE BOOST_TEST_DYN_LINK)
  else()
    find_path(TRAINLOOP_BOOST_TEST_INCLUDE_DIR boost/test/included/unit_test.hpp)
    if(TRAINLOOP_BOOST_TEST_INCLUDE_DIR)
      message(STATUS "trainloop tests: header-only Boost.Test from ${TRAINLOOP_BOOST_TEST_INCLUDE_DIR}")
      target_include_directories(trainloop_boost_test SYSTEM INTERFACE ${TRAINLOOP_BOOST_TEST_INCLUDE_DIR})
      target_compile_definitions(trainloop_boost_test INTERFACE TRAINLOOP_BOOST_TEST_HEADER_ONLY)
    elseif(TRAINLOOP_BUILD_TESTS)
      message(FATAL_ERROR "trainloop tests: Boost.Test was not found (Debian: libboost-test-dev); expected "
              "Boost::unit_test_framework or boost/test/included/unit_test.hpp, or -DTRAINLOOP_BUILD_TESTS=OFF")
    endif()
  endif()
  # The Python of the venv this libtorch came from (pip torch: <venv>/lib/pythonX.Y/site-packages/
  # torch): the tests' reference (tests/python_reference.hpp), which must be the same release.
  get_filename_component(_trainloop_venv "${TORCH_INSTALL_PREFIX}/../../../.." ABSOLUTE)
  # trainloop_torch_python: the same, for the tests that are scripts (their TRAINLOOP_PYTHON).
  set(trainloop_torch_python "")
  if(TORCH_INSTALL_PREFIX AND EXISTS "${_trainloop_venv}/bin/python")
    target_compile_definitions(trainloop_boost_test INTERFACE TRAINLOOP_TORCH_PYTHON="${_trainloop_venv}/bin/python")
    set(trainloop_torch_python "${_trainloop_venv}/bin/python")
  endif()
endmacro()

# An object library `target` whose only job is to precompile the headers in ARGN with the flags of
# trainloop's own programs (trainloop::trainloop, trainloop_warnings, Boost.Test's definitions);
# other targets reuse it with target_precompile_headers(... REUSE_FROM target).
function(trainloop_add_pch_target target)
  set(anchor ${CMAKE_CURRENT_BINARY_DIR}/${target}.cpp)
  if(NOT EXISTS ${anchor})
    file(WRITE ${anchor} "// Only here so that ${target} has a source to build its PCH with.\n")
  endif()
  add_library(${target} OBJECT ${anchor})
  # The anchor is only preprocessed (-E: its "object" is the headers' text, which nothing uses).
  # Why: the programs need only the PCH, but an anchor compiled with it paid every source's fixed
  # cost of the PCH (GCC's deferred template instantiations, ~24 s of -ftime-report's "template
  # instantiation", 1 GB) for nothing: 29-35 s of each cold build (2-core AMD EPYC, torch 2.15
  # and 2.11, GCC 12, .ninja_log of 2026-11-28). It cannot be left out: CMake makes a PCH only for
  # a target with a source that uses it (SKIP_PRECOMPILE_HEADERS fails at generation), and every
  # custom target of a program that reuses the PCH waits for the whole target (EXCLUDE_FROM_ALL
  # builds it anyway).
  set_source_files_properties(${anchor} PROPERTIES COMPILE_OPTIONS -E)
  target_link_libraries(${target} PRIVATE trainloop::trainloop trainloop_warnings)
  target_compile_definitions(${target} PRIVATE $<TARGET_PROPERTY:trainloop_boost_test,INTERFACE_COMPILE_DEFINITIONS>)
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Winvalid-pch>)
  target_precompile_headers(${target} PRIVATE ${ARGN})
  # At the tests' level (most of its users; the top-level CMakeLists.txt says why GCC accepts it at
  # the examples' -O3 too). Why: what a program pays for loading the PCH depends on the level the
  # PCH was built at. Built at -O3, an empty source loading it sent 17,284 functions through GCC's
  # early optimizations, at -O3 or at -O1 alike (61 s, 27 s); built at -O1, 640 (22 s at -O1), the
  # same as the headers included as text (2-core AMD EPYC, torch 2.15, GCC 12, -fdump-tree-einline).
  # At the tests' -Og now: the PCH itself 92 s (-O1: 111 s), an empty source loading it 24 s at -Og
  # (-O1: 38 s), each measured alone.
  if(TRAINLOOP_TESTS_OPTIMIZATION)
    target_compile_options(${target} PRIVATE $<$<NOT:$<CONFIG:Debug>>:${TRAINLOOP_TESTS_OPTIMIZATION}>)
  endif()
endfunction()

# Creates the PCH target `trainloop_shared_pch` (when TRAINLOOP_SHARED_PCH is on) with the headers
# that most programs include (counted over tests/, examples/, benchmarks/ and the snippets):
# torch, trainloop's umbrella, interop and the zoo, and the standard headers they use.
function(trainloop_add_shared_pch)
  if(TRAINLOOP_SHARED_PCH)
    trainloop_add_pch_target(trainloop_shared_pch
      <torch/torch.h> <trainloop/trainloop.hpp> <trainloop/interop.hpp> <trainloop/models.hpp>
      <algorithm> <chrono> <cstdio> <cstdlib> <filesystem> <fstream> <iostream> <map> <sstream> <string>
      <thread> <vector>)
  endif()
endfunction()

# Makes `target` (a program of trainloop's own build that links trainloop::trainloop) reuse the
# shared PCH, unless its directory compiles at another level than the PCH
# (`trainloop_without_shared_pch`, set by trainloop_use_examples_optimization: the top-level
# CMakeLists.txt says why).
function(trainloop_use_shared_pch target)
  if(NOT TARGET trainloop_shared_pch OR trainloop_without_shared_pch)
    return()
  endif()
  target_link_libraries(${target} PRIVATE trainloop_warnings)
  target_compile_definitions(${target} PRIVATE $<TARGET_PROPERTY:trainloop_boost_test,INTERFACE_COMPILE_DEFINITIONS>)
  target_compile_options(${target} PRIVATE $<$<CXX_COMPILER_ID:GNU>:-Winvalid-pch>)
  target_precompile_headers(${target} REUSE_FROM trainloop_shared_pch)
endfunction()
