# Checks that headers include only what their layer may: a header may include headers of its own
# unit and of lower layers, never of a higher or the same (other) layer, so no two units include
# each other, and the core (loop/, engine/, the Callback interface) stays below everything
# concrete: distributed/*, replicas/, the callbacks, gpu_mode/.
#
#   cmake -DINCLUDE_DIR=<repo>/include -P check_include_layers.cmake
#
# A unit is a file at the top, a folder, a subfolder, or a single file: a header belongs to the
# longest entry of the table its path starts with (distributed/ddp/gradient_reducer.hpp is in
# "distributed/ddp"; callbacks/callback.hpp is its own unit, the other callbacks are "callbacks").
# Lower numbers are lower layers. A new folder must be given a layer here (the check fails
# naming it otherwise), which is the point: where it sits is a decision, not an accident.
# tests/layering/check_catches_violations.cmake proves the check fails on a core that reaches up.
set(layers
  "error.hpp=0" "version.hpp=0"
  # What fit() returns: its reads name what is missing in the error types of error.hpp.
  "history.hpp=5"
  "detail=10"
  # Where this process is (the beacon the loop sets, collectives' fingerprints, thread stacks):
  # below everything that reports progress, the data loader included.
  "progress=15"
  "cpu=20" "data=20" "metrics=20" "nn=20" "optim=20" "precision=20"
  "model_contract.hpp=30" "options.hpp=30"
  "serialization=30"
  # Runs torch.export programs read by serialization/export: above the readers, below interop.
  "interpreter=35"
  "checkpoint=40" "models=40"
  # The Callback interface and the monitored value every watcher shares: below the core.
  "callbacks/callback.hpp=50" "callbacks/monitor.hpp=50" "interop=50"
  "schedules=60"
  "engine=70" "finetune=70"
  # The core: one loop behind the engine interface. It knows no mode, no concrete callback, and
  # nothing of distributed/.
  "loop=80"
  # Concrete parts, above the core. distributed/, by concept: who this process is in the job;
  # the process group and its collectives; starting and watching ranks (and their failure
  # report); the spawn relay; ZeRO's optimizer shard; DDP's gradient reduction and comm hooks.
  "distributed/job=90" "replicas=90" "callbacks=90"
  "distributed/comm=100" "distributed/launch=100"
  # The stall watchdog: publishes the beacon through the store, reports as a failed rank does.
  "distributed/watch=105"
  "distributed/zero=110" "distributed/spawn=110"
  # Elastic training: the survivors of a lost rank regroup (comm, watch) and resume the loop's
  # fit (engine's FitActions) from the newest step one of them committed.
  "distributed/elastic=115"
  "distributed/ddp=120"
  "gpu_mode=130"
  "train_loop.hpp=140"
  "trainloop.hpp=150" "models.hpp=150" "interop.hpp=150")

function(layer_of unit out)
  foreach(entry IN LISTS layers)
    string(REPLACE "=" ";" pair "${entry}")
    list(GET pair 0 name)
    list(GET pair 1 level)
    if(name STREQUAL unit)
      set(${out} ${level} PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(${out} "" PARENT_SCOPE)
endfunction()

# The unit of a path below include/trainloop: the longest table entry that is the path or one of
# its folders; with none, its first folder (or the file name at the top), which has no layer.
function(unit_of relative out)
  set(best "")
  string(LENGTH "" best_length)
  foreach(entry IN LISTS layers)
    string(REPLACE "=" ";" pair "${entry}")
    list(GET pair 0 name)
    string(LENGTH "${name}" length)
    string(FIND "${relative}/" "${name}/" at)
    if(at EQUAL 0 AND length GREATER best_length)
      set(best "${name}")
      set(best_length ${length})
    endif()
  endforeach()
  if(best STREQUAL "")
    # Unplaced: its first folder, or its first two where the table splits that folder by concept.
    string(REGEX MATCH "^[^/]+" best "${relative}")
    string(REGEX MATCH "^[^/]+/[^/]+/" two "${relative}")
    if(two AND "${layers}" MATCHES "(^|;)${best}/")
      string(REGEX REPLACE "/$" "" best "${two}")
    endif()
  endif()
  set(${out} "${best}" PARENT_SCOPE)
endfunction()

if(NOT INCLUDE_DIR)
  message(FATAL_ERROR "INCLUDE_DIR is not set; expected -DINCLUDE_DIR=<repository>/include")
endif()
file(GLOB_RECURSE headers RELATIVE "${INCLUDE_DIR}/trainloop" "${INCLUDE_DIR}/trainloop/*.hpp")
set(violations "")
set(checked 0)
foreach(header IN LISTS headers)
  unit_of("${header}" from)
  layer_of("${from}" from_level)
  if(from_level STREQUAL "")
    string(APPEND violations "\n  ${header}: folder or file '${from}' has no layer; give it one in check_include_layers.cmake")
    continue()
  endif()
  file(STRINGS "${INCLUDE_DIR}/trainloop/${header}" includes REGEX "^[ \t]*#[ \t]*include[ \t]*<trainloop/")
  foreach(line IN LISTS includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<trainloop/([^>]+)>.*$" "\\1" included "${line}")
    unit_of("${included}" to)
    math(EXPR checked "${checked} + 1")
    if(to STREQUAL from)
      continue()
    endif()
    layer_of("${to}" to_level)
    if(to_level STREQUAL "")
      string(APPEND violations "\n  ${header} includes trainloop/${included}: '${to}' has no layer")
    elseif(NOT to_level LESS from_level)
      string(APPEND violations "\n  ${header} (layer ${from_level}, ${from}) includes trainloop/${included} (layer ${to_level}, ${to}); expected only lower layers")
    endif()
  endforeach()
endforeach()
list(LENGTH headers header_count)
if(violations)
  message(FATAL_ERROR "include layering violated:${violations}")
endif()
message(STATUS "include layering holds: ${header_count} headers, ${checked} trainloop includes checked")
