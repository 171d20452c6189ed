# Pieces shared by the scripts that build a consumer project in a test (trainloopCheckImport.cmake,
# trainloopCheckSubdirectory.cmake), run as `cmake -P`.

# Fails with FATAL_ERROR when a required -D variable is missing.
function(trainloop_require_variables script)
  foreach(var IN LISTS ARGN)
    if(NOT DEFINED ${var})
      message(FATAL_ERROR "${script}: -D${var}=... is required")
    endif()
  endforeach()
endfunction()

# Runs the command held in the list *variable* `command_var` (passing it through ARGN would split
# the escaped semicolons of -DCMAKE_PREFIX_PATH=a;b into separate arguments); FATAL_ERROR naming
# `label` and `what` when it fails.
function(trainloop_run_step label what command_var)
  execute_process(COMMAND ${${command_var}} RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${label}: ${what} failed (exit status ${status})")
  endif()
endfunction()

# Appends to the list `command_var` the options that make the consumer build like trainloop's
# own build: GENERATOR, MAKE_PROGRAM, CXX_COMPILER, GLOO_INCLUDE_DIR (each when set).
function(trainloop_append_build_options command_var)
  set(command ${${command_var}})
  if(GENERATOR)
    list(APPEND command -G "${GENERATOR}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND command "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(CXX_COMPILER)
    list(APPEND command "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
  endif()
  if(GLOO_INCLUDE_DIR)
    list(APPEND command "-DTRAINLOOP_GLOO_INCLUDE_DIR=${GLOO_INCLUDE_DIR}")
  endif()
  # The consumer keeps its build type (the checks read it) but compiles at -O0 without -g: these
  # tests check the package, not the code's speed, and one TU including <trainloop/trainloop.hpp>
  # without a PCH takes ~170 s at -O3 on CI's 2 cores, ~105 s at -O1 (three consumers: 291 s of
  # the cold run of 2026-11-28) and about a third less at -O0 (unit_data: -O1 117 s, -O0 74 s).
  list(APPEND command "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O0 -DNDEBUG")
  trainloop_append_ccache(command)
  set(${command_var} ${command} PARENT_SCOPE)
endfunction()

# With CCACHE set (and CCACHE_BASEDIR, CCACHE_MAXSIZE): appends the compiler launcher to the configure
# command in the list `command_var` and sets ccache's environment, which reaches the build this
# script runs. trainloop's own build compiles through ccache, and so do the builds its tests make
# (the consumers, the fuzz target), so a warm CI takes their compiles from the cache too.
function(trainloop_append_ccache command_var)
  if(CCACHE)
    set(${command_var} ${${command_var}} "-DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE}" PARENT_SCOPE)
    set(ENV{CCACHE_BASEDIR} "${CCACHE_BASEDIR}")
    set(ENV{CCACHE_SLOPPINESS} "time_macros,include_file_mtime,include_file_ctime")
    if(CCACHE_MAXSIZE)
      set(ENV{CCACHE_MAXSIZE} "${CCACHE_MAXSIZE}")
    endif()
  endif()
endfunction()
