# Read by ctest after every program's case list (the last of tests/'s TEST_INCLUDE_FILES): the
# seconds the longest discovered entries took in CI's cold run of 2026-11-28 (2 cores, ctest -j2).
# ctest starts entries in descending COST; without it a clean clone (no Testing/CTestCostData.txt)
# starts them in file order, and test_exported_program/against_python (~300 s, holding the "ranks"
# lock) began as the 233rd of 394 and ran on alone at the end of the 2.11 run. Only the order
# matters; an entry that is not defined (not built, other labels) is ignored. The entries defined
# in tests/CMakeLists.txt itself (fuzz, consumers, examples, compile_fail) set COST where defined;
# test_exported_program/python_references (84 s in the cold run of 8613515, against_python's
# fixture) sets its own in the file tests/CMakeLists.txt generates. against_python: 214 s there.
set_tests_properties([=[test_exported_program/against_python]=] PROPERTIES COST 300)
set_tests_properties(
  [=[test_sharding/every_sharding_level_restarts_bit_for_bit_and_its_checkpoints_resume_in_any_mode_and_world_size]=]
  PROPERTIES COST 50)
set_tests_properties([=[test_python_weights/resnet18_both_directions]=] PROPERTIES COST 24)
set_tests_properties(
  [=[test_sharding/every_sharding_level_with_adam_equals_plain_ddp_and_each_rank_holds_a_share_of_the_state]=]
  PROPERTIES COST 24)
set_tests_properties(
  [=[test_sharded_evaluation/validation_and_predict_at_full_equal_ddp_and_one_process_without_a_whole_model_gather]=]
  PROPERTIES COST 22)
set_tests_properties([=[test_python_weights/small_model_both_directions]=] PROPERTIES COST 21)
set_tests_properties([=[test_script_module/scripted_torchvision_resnet18_trains_like_python_eager]=] PROPERTIES COST 21)
