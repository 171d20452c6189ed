# Checks that headers include only what their layer may: a header may include headers of its own
# folder and of lower layers, never of a higher or the same (other) layer, so no two folders
# include each other and the core stays free of concrete callbacks and modes.
#
#   cmake -DINCLUDE_DIR=<repo>/include -P check_include_layers.cmake
#
# Lower numbers are lower layers. A new folder must be given a layer here (the check fails
# naming it otherwise), which is the point: where it sits is a decision, not an accident.
set(layers
  "error.hpp=0" "version.hpp=0" "history.hpp=0"
  "detail=1"
  "cpu=2" "data=2" "metrics=2" "nn=2" "optim=2" "precision=2"
  "model_contract.hpp=3" "options.hpp=3"
  "serialization=3"
  "checkpoint=4" "models=4"
  "callbacks=5" "interop=5"
  "schedules=6"
  "engine=7" "finetune=7"
  "distributed=8" "replicas=8"
  "gpu_mode=9"
  "loop=10"
  "train_loop.hpp=11"
  "trainloop.hpp=12" "models.hpp=12" "interop.hpp=12")

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

# The unit of a path below include/trainloop: its first folder, or the file name at the top.
function(unit_of relative out)
  string(FIND "${relative}" "/" slash)
  if(slash EQUAL -1)
    set(${out} "${relative}" PARENT_SCOPE)
  else()
    string(SUBSTRING "${relative}" 0 ${slash} folder)
    set(${out} "${folder}" PARENT_SCOPE)
  endif()
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
