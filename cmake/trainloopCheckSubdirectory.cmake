# Run by the ctest tests `cmake_subdirectory` and `cmake_fetchcontent` as
# `cmake -D... -P trainloopCheckSubdirectory.cmake`: configures tests/cmake_subdirectory (a
# consumer that takes trainloop's sources with add_subdirectory() or FetchContent and never calls
# find_package(Torch) itself), builds it and runs it. Fails at the first step that does not work.
#
# Inputs (-D):
#   HOW                   add_subdirectory or FetchContent
#   TRAINLOOP_SOURCE_DIR  trainloop's source tree
#   CONSUMER_SOURCE_DIR   tests/cmake_subdirectory
#   WORK_DIR              scratch build directory (emptied first)
#   PREFIX_PATH           where libtorch and range-v3 are found, '|'-separated (may be empty)
#   GENERATOR, MAKE_PROGRAM, CXX_COMPILER   reused so the consumer builds alike
#   GLOO_INCLUDE_DIR      where Gloo's headers are (TRAINLOOP_GLOO_INCLUDE_DIR of the build)
cmake_minimum_required(VERSION 3.18)

include("${CMAKE_CURRENT_LIST_DIR}/trainloopConsumerCheck.cmake")
trainloop_require_variables(trainloopCheckSubdirectory.cmake HOW TRAINLOOP_SOURCE_DIR CONSUMER_SOURCE_DIR WORK_DIR)


file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")
string(REPLACE "|" ":" prefix_path_env "${PREFIX_PATH}")

# The consumer's own build type, which trainloop must leave alone.
set(configure_command "${CMAKE_COMMAND}" -E env "CMAKE_PREFIX_PATH=${prefix_path_env}"
  "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${WORK_DIR}"
  "-DHOW=${HOW}" "-DTRAINLOOP_SOURCE_DIR=${TRAINLOOP_SOURCE_DIR}"
  "-DFETCHCONTENT_SOURCE_DIR_TRAINLOOP=${TRAINLOOP_SOURCE_DIR}"
  -DCMAKE_BUILD_TYPE=RelWithDebInfo -DEXPECTED_BUILD_TYPE=RelWithDebInfo)
trainloop_append_build_options(configure_command)
message(STATUS "${HOW}: configuring the consumer")
trainloop_run_step("${HOW}" "configuring the consumer" configure_command)
message(STATUS "${HOW}: building the consumer")
set(build_command "${CMAKE_COMMAND}" --build "${WORK_DIR}" --target trainloop_consumer)
trainloop_run_step("${HOW}" "building the consumer" build_command)
set(run_command "${CMAKE_COMMAND}" -E env "TRAINLOOP_EXPECT_LIBRARIES_UNDER=${EXPECT_LIBRARIES_UNDER}"
    "${WORK_DIR}/trainloop_consumer")
trainloop_run_step("${HOW}" "running the consumer" run_command)
message(STATUS "${HOW}: trainloop works as a subproject")
