// Every compile-fail case in one translation unit, built by ctest's compile_fail (never by `all`)
// and checked by check_compile_fail.cmake: the compile must fail, and its output must carry each
// case's static_assert text, the words a user would read. GCC reports each failed static_assert and
// goes on, so one compile checks all six: as six programs they took ~300 s of CI's CPU (each
// ~40-57 s, cold run of 2026-11-28), as one ~60 s. Each case is its own file and namespace.

#include <trainloop/trainloop.hpp>

#include "batch_without_split.cpp"
#include "dataset_of_other_batches.cpp"
#include "deduced_model_by_value.cpp"
#include "engine_without_eval_batch.cpp"
#include "model_without_contract.cpp"
#include "no_criterion.cpp"

int main() {
  compile_fail_batch_without_split::run();
  compile_fail_dataset_of_other_batches::run();
  compile_fail_deduced_model_by_value::run();
  compile_fail_engine_without_eval_batch::run();
  compile_fail_model_without_contract::run();
  compile_fail_no_criterion::run();
}
