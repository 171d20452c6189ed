#define BOOST_TEST_MODULE test_comm_hooks
#include "unit_test.hpp"

// DDP's comm hooks (fp16, bf16, PowerSGD) in spawned ranks: a hook's state in the checkpoints and
// restarts. What each hook sends and its numbers in one process: test_gradient_reducer; fp16 and
// bf16 against one process: test_equivalence.

#include "ddp_test_support.hpp"

#include <filesystem>
#include <string>


// PowerSGD's state (Q and error feedback, per rank) is in the checkpoints: 20 steps, compression
// from step 11, rank 1 killed at step 15, all ranks restart from step 14's checkpoint.
BOOST_AUTO_TEST_CASE(a_powersgd_run_killed_after_compression_began_restarts_bit_for_bit) {
  auto dir = fresh_dir("powersgd_ckpt");
  const std::string common = "TL_TEST_COMM_HOOK=powersgd:2 TL_TEST_EPOCHS=4 TL_TEST_EVERY_STEPS=2 ";
  auto full = run_ckpt("powersgd_full", dir / "full", common);
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  auto killed = run_ckpt("powersgd_killed", dir / "killed", common + "TL_TEST_KILL_AT_STEP=15 TL_TEST_MAX_RESTARTS=1");
  BOOST_REQUIRE_MESSAGE(killed.exit_code == 0, killed.output);
  BOOST_TEST(killed.output.find("restarting all ranks from the newest checkpoint") != std::string::npos);
  BOOST_TEST(torch::equal(load_params((killed.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
  // The checkpoint holds both ranks' state, and PowerSGD changed the result (it is not the all-reduce).
  torch::serialize::InputArchive archive, ours, optimizer, hooks;
  archive.load_from((dir / "full" / "last.ckpt").string());
  BOOST_REQUIRE(archive.try_read("__trainloop__", ours) && ours.try_read("optimizer", optimizer));
  BOOST_REQUIRE(optimizer.try_read("trainloop_comm_hook", hooks));
  torch::Tensor rank0, rank1;
  BOOST_TEST((hooks.try_read("rank0", rank0) && hooks.try_read("rank1", rank1)));
  auto plain = run_ckpt("powersgd_none", dir / "none", "TL_TEST_EPOCHS=4");
  BOOST_REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  const double compressed = (load_params((full.dir / "params.pt").string()) - load_params((plain.dir / "params.pt").string()))
                                .abs().max().item<double>();
  BOOST_TEST_MESSAGE("PowerSGD rank 2 vs the all-reduce after 20 steps: max |diff| " << compressed);
  BOOST_TEST(compressed > 1e-6);
  for (auto* run : {&full, &killed, &plain}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}
