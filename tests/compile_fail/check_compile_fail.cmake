# ctest's compile_fail: builds the target holding all_cases.cpp, which must not compile, and finds
# in the compiler's output each case's static_assert text (the words a user reads). A case whose
# text is missing is named; so is a compile that succeeds.
#
#   cmake -DBUILD_DIR=<build> -DTARGET=<target> -P check_compile_fail.cmake

cmake_minimum_required(VERSION 3.20)
foreach(required BUILD_DIR TARGET)
  if(NOT ${required})
    message(FATAL_ERROR "${required} is not set; expected -D${required}=...")
  endif()
endforeach()

# case file | the static_assert text its compile must print
set(cases
  "no_criterion.cpp|a TrainLoop built without a criterion needs a model that computes its own loss"
  "model_without_contract.cpp|the model does not fit a training contract"
  "batch_without_split.cpp|gpu_mode::DataParallel cannot split this batch type across replicas"
  "dataset_of_other_batches.cpp|the dataset's batches are not of the TrainLoop's Batch type"
  "engine_without_eval_batch.cpp|GpuMode's engine cannot train or evaluate this Batch type"
  "deduced_model_by_value.cpp|TrainLoop cannot deduce its Model from the model argument")

execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${TARGET}
                RESULT_VARIABLE status OUTPUT_VARIABLE output ERROR_VARIABLE output)
if(status EQUAL 0)
  message(FATAL_ERROR "${TARGET} compiled; expected each case of tests/compile_fail/all_cases.cpp to stop it")
endif()
set(missing "")
foreach(case IN LISTS cases)
  string(REPLACE "|" ";" case "${case}")
  list(GET case 0 file)
  list(GET case 1 text)
  string(FIND "${output}" "${text}" at)
  string(FIND "${output}" "${file}:" where)  # the case's own line in "required from here"
  if(at EQUAL -1 OR where EQUAL -1)
    string(APPEND missing "  ${file}: \"${text}\"\n")
  else()
    message(STATUS "${file}: stopped with \"${text}\"")
  endif()
endforeach()
if(missing)
  message(FATAL_ERROR "${TARGET}'s compile failed, but not with every case's text; missing:\n${missing}"
                      "The compiler said:\n${output}")
endif()
