# With Python torch out of reach (TRAINLOOP_PYTHON names no python), runs PROGRAM's ctest entries
# and checks that skips are per case: every case that needs Python (precondition(python_present)
# in SOURCE) is Skipped, every other case Passed, none Failed. Then proves a C++-only case still
# fails when it breaks: with TMPDIR pointing nowhere its TempDir cannot be made, and ctest must
# report that case Failed (not Skipped, as a per-program skip token once did).
#
#   cmake -DCTEST=<ctest> -DBUILD_DIR=<build>/tests -DPROGRAM=test_python_weights
#         -DSOURCE=<repo>/tests/test_python_weights.cpp -DFAILING_CASE=<a C++-only case> -P check_python_hidden.cmake

cmake_minimum_required(VERSION 3.20)  # IN_LIST, and ctest --test-dir

foreach(required CTEST BUILD_DIR PROGRAM SOURCE FAILING_CASE)
  if(NOT ${required})
    message(FATAL_ERROR "${required} is not set")
  endif()
endforeach()

# What the source says: cases with and without the Python precondition.
file(STRINGS ${SOURCE} case_lines REGEX "^BOOST_AUTO_TEST_CASE\\(")
set(python_cases "")
set(cpp_cases "")
foreach(line IN LISTS case_lines)
  string(REGEX REPLACE "^BOOST_AUTO_TEST_CASE\\(([A-Za-z0-9_]+).*" "\\1" name "${line}")
  if(line MATCHES "python_present")
    list(APPEND python_cases ${name})
  else()
    list(APPEND cpp_cases ${name})
  endif()
endforeach()
if(NOT python_cases OR NOT cpp_cases)
  message(FATAL_ERROR "${SOURCE} should have cases with and without python_present; found Python: "
                      "[${python_cases}], C++: [${cpp_cases}]")
endif()
if(NOT FAILING_CASE IN_LIST cpp_cases)
  message(FATAL_ERROR "FAILING_CASE ${FAILING_CASE} is not a C++-only case of ${SOURCE}")
endif()

function(run_ctest regex out)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env TRAINLOOP_PYTHON=/nonexistent/python3 ${ARGN}
                          ${CTEST} --test-dir ${BUILD_DIR} -R "${regex}" --output-on-failure
                  OUTPUT_VARIABLE output ERROR_VARIABLE output)
  set(${out} "${output}" PARENT_SCOPE)
endfunction()

run_ctest("^${PROGRAM}/" output)
set(problems "")
foreach(name IN LISTS python_cases cpp_cases)
  if(name IN_LIST python_cases)
    set(expected "\\*\\*\\*Skipped")
  else()
    set(expected "Passed")
  endif()
  if(NOT output MATCHES "${PROGRAM}/${name} [ .]*${expected}")
    string(APPEND problems "\n  ${PROGRAM}/${name}: expected ${expected}")
  endif()
endforeach()
if(problems)
  message(FATAL_ERROR "with Python torch hidden:${problems}\nctest said:\n${output}")
endif()
list(LENGTH python_cases skipped)
list(LENGTH cpp_cases passed)
message(STATUS "Python hidden: ${skipped} Python cases Skipped, ${passed} C++-only cases Passed")

run_ctest("^${PROGRAM}/${FAILING_CASE}$" output TMPDIR=/nonexistent/tmp)
if(NOT output MATCHES "${PROGRAM}/${FAILING_CASE} [ .]*\\*\\*\\*Failed")
  message(FATAL_ERROR "${PROGRAM}/${FAILING_CASE} with TMPDIR=/nonexistent/tmp and Python hidden: expected "
                      "ctest to report it Failed. ctest said:\n${output}")
endif()
message(STATUS "a broken C++-only case is reported Failed with Python hidden: ${FAILING_CASE}")
