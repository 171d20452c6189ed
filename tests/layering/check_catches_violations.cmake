# Proves check_include_layers.cmake can fail: copies include/ to a scratch folder, plants one
# violation at a time (what the old flat layout did, and what the layers forbid), and expects the
# check to fail naming it. Then checks the untouched copy passes.
#
#   cmake -DINCLUDE_DIR=<repo>/include -DWORK_DIR=<scratch> -P check_catches_violations.cmake

if(NOT INCLUDE_DIR OR NOT WORK_DIR)
  message(FATAL_ERROR "INCLUDE_DIR and WORK_DIR must be set")
endif()
set(check ${CMAKE_CURRENT_LIST_DIR}/check_include_layers.cmake)

# Each case: header to edit | include to plant | text the check's error must contain.
set(cases
  # The old layout: the loop reached into distributed/ for gather_rows.
  "loop/fit_runner.hpp|trainloop/distributed/comm/process_group.hpp|loop/fit_runner.hpp (layer 80, loop) includes trainloop/distributed/comm/process_group.hpp"
  # The core must not know a concrete mode or callback.
  "loop/epoch_trainer.hpp|trainloop/gpu_mode/single.hpp|(layer 80, loop) includes trainloop/gpu_mode/single.hpp (layer 130"
  "engine/mode_engine.hpp|trainloop/callbacks/csv_logger.hpp|(layer 70, engine) includes trainloop/callbacks/csv_logger.hpp (layer 90, callbacks)"
  "callbacks/callback.hpp|trainloop/callbacks/early_stopping.hpp|(layer 50, callbacks/callback.hpp) includes trainloop/callbacks/early_stopping.hpp"
  # Subfolders of distributed/ are units of their own: the process group knows no DDP reducer,
  # and two units of one layer do not include each other.
  "distributed/comm/process_group.hpp|trainloop/distributed/ddp/gradient_reducer.hpp|(layer 100, distributed/comm) includes trainloop/distributed/ddp/gradient_reducer.hpp (layer 120"
  "distributed/comm/rendezvous.hpp|trainloop/distributed/launch/launcher.hpp|(layer 100, distributed/comm) includes trainloop/distributed/launch/launcher.hpp (layer 100"
  # A folder nobody placed.
  "distributed/new_concept/thing.hpp|trainloop/error.hpp|folder or file 'distributed/new_concept' has no layer")

set(copy ${WORK_DIR}/include)
foreach(case IN LISTS cases)
  string(REPLACE "|" ";" fields "${case}")
  list(GET fields 0 header)
  list(GET fields 1 planted)
  list(GET fields 2 expected)
  file(REMOVE_RECURSE ${copy})
  file(COPY ${INCLUDE_DIR}/trainloop DESTINATION ${copy})
  file(APPEND ${copy}/trainloop/${header} "\n#include <${planted}>\n")
  execute_process(COMMAND ${CMAKE_COMMAND} -DINCLUDE_DIR=${copy} -P ${check}
                  RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
  string(REGEX REPLACE "[ \t\r\n]+" " " flat "${output}")
  string(FIND "${flat}" "${expected}" at)
  if(result EQUAL 0 OR at EQUAL -1)
    message(FATAL_ERROR "the layering check let through ${header} including <${planted}>; expected it to fail "
                        "with \"${expected}\". It said (exit ${result}):\n${output}")
  endif()
  message(STATUS "caught: ${header} including <${planted}>")
endforeach()
file(REMOVE_RECURSE ${copy})
file(COPY ${INCLUDE_DIR}/trainloop DESTINATION ${copy})
execute_process(COMMAND ${CMAKE_COMMAND} -DINCLUDE_DIR=${copy} -P ${check} RESULT_VARIABLE result OUTPUT_VARIABLE output ERROR_VARIABLE output)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "the untouched copy fails the layering check:\n${output}")
endif()
file(REMOVE_RECURSE ${WORK_DIR})
