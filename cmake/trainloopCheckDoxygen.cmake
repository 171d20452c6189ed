# Run by the ctest test `doxygen_no_warnings` as `cmake -D... -P trainloopCheckDoxygen.cmake`:
# builds the API documentation from the repository's Doxyfile into OUTPUT_DIR and fails when
# doxygen reports anything — a warning log that is not empty, or a non-zero exit status.
#
# Inputs (-D): DOXYGEN (the executable), SOURCE_DIR (repository root, holds Doxyfile),
#              OUTPUT_DIR (emptied first), PROJECT_VERSION (optional, shown in the pages).
cmake_minimum_required(VERSION 3.18)

foreach(var DOXYGEN SOURCE_DIR OUTPUT_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "trainloopCheckDoxygen.cmake: -D${var}=... is required")
  endif()
endforeach()

file(REMOVE_RECURSE "${OUTPUT_DIR}")
file(MAKE_DIRECTORY "${OUTPUT_DIR}")
set(log "${OUTPUT_DIR}/warnings.log")
# The repository's Doxyfile, with the output redirected into the build tree and every warning
# collected in one log instead of stopping at the first.
set(doxyfile "${OUTPUT_DIR}/Doxyfile")
set(overrides
  "@INCLUDE = \"${SOURCE_DIR}/Doxyfile\""
  "OUTPUT_DIRECTORY = \"${OUTPUT_DIR}\""
  "WARN_LOGFILE = \"${log}\""
  "WARN_AS_ERROR = NO")
if(PROJECT_VERSION)
  list(APPEND overrides "PROJECT_NUMBER = ${PROJECT_VERSION}")
endif()
list(JOIN overrides "\n" text)
file(WRITE "${doxyfile}" "${text}\n")

# Doxyfile paths (INPUT = include README.md) are relative to the repository root.
execute_process(COMMAND "${DOXYGEN}" "${doxyfile}" WORKING_DIRECTORY "${SOURCE_DIR}"
                RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output)
set(warnings "")
if(EXISTS "${log}")
  file(READ "${log}" warnings)
  string(STRIP "${warnings}" warnings)
endif()
if(NOT status EQUAL 0 OR NOT warnings STREQUAL "")
  # Printed as is (FATAL_ERROR would re-wrap the file:line lines).
  message(NOTICE "${output}\n${warnings}")
  string(REGEX MATCHALL "\n" lines "\n${warnings}")
  list(LENGTH lines count)
  message(FATAL_ERROR "doxygen_no_warnings: doxygen exited with status ${status} and wrote "
                      "${count} lines of warnings (above; log: ${log})")
endif()
if(NOT EXISTS "${OUTPUT_DIR}/html/index.html")
  message(FATAL_ERROR "doxygen_no_warnings: no ${OUTPUT_DIR}/html/index.html was written")
endif()
message(STATUS "doxygen_no_warnings: no warnings; documentation in ${OUTPUT_DIR}/html")
