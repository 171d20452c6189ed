#define BOOST_TEST_MODULE test_torchrun
#include "unit_test.hpp"

// Ranks started by the real torchrun (`torchrun --nproc-per-node 2 --no-python ddp_worker ...`,
// from the Python torch of the libtorch under test: $TRAINLOOP_PYTHON -m torch.distributed.run,
// else `torchrun` on PATH) join the job and behave as with trainloop's own launcher:
// - 2 ranks x batch 4 equal one process with batch 8;
// - a rank SIGKILLed mid-training ends every rank, and torchrun exits non-zero;
// - with --max-restarts 1, torchrun restarts the ranks, which resume from the newest checkpoint
//   by themselves and end bit for bit as an uninterrupted torchrun job.
// Each case is skipped where no torchrun works (Debian's torchrun 1.13 fails on Python 3.11);
// scripts/test.sh runs these with the torchrun of the pip torch it builds against.

#include "ddp_test_model.hpp"
#include "test_paths.hpp"
#include "test_support.hpp"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

namespace fs = std::filesystem;

namespace {

/// The torchrun command, or "" when none runs here.
const std::string& torchrun() {
  static const std::string found = [] {
    std::vector<std::string> candidates;
    if (const char* python = std::getenv("TRAINLOOP_PYTHON")) candidates.push_back("'" + std::string(python) + "' -m torch.distributed.run");
#ifdef TRAINLOOP_TORCH_PYTHON  // the venv's Python of this build's libtorch (tests/python_reference.hpp)
    candidates.push_back("'" + std::string(TRAINLOOP_TORCH_PYTHON) + "' -m torch.distributed.run");
#endif
    candidates.push_back("torchrun");
    for (const auto& candidate : candidates) {
      // A whole job of one rank that runs `true`: a torchrun can pass --help and still fail
      // here (an old one lacks the --nproc-per-node spelling).
      if (std::system((candidate + " --standalone --nproc-per-node 1 --no-python true > /dev/null 2>&1").c_str()) == 0) {
        return candidate;
      }
    }
    return std::string();
  }();
  return found;
}

boost::test_tools::assertion_result torchrun_works(boost::unit_test::test_unit_id) {
  if (!torchrun().empty()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: no torchrun runs here (pip torch 2.x's: scripts/install-deps.sh, "
               "TRAINLOOP_PYTHON=<its python>)"
            << std::endl;
  boost::test_tools::assertion_result result(false);
  result.message() << "no working torchrun";
  return result;
}

/// `env torchrun --standalone --nproc-per-node 2 [flags] --no-python ddp_worker scenario 2 dir`.
CommandRun run_torchrun(const std::string& env, const std::string& flags, const std::string& scenario,
                        const fs::path& dir) {
  return run_command("env " + env + " " + torchrun() + " --standalone --nproc-per-node 2 " + flags +
                     " --no-python " + test_program("ddp_worker") + " " + scenario + " 2 '" + dir.string() + "' 2>&1");
}

int leftover_workers() { return processes_running("ddp_worker"); }

}  // namespace

BOOST_AUTO_TEST_CASE(two_ranks_under_torchrun_equal_one_process_with_the_combined_batch,
                     *boost::unit_test::precondition(torchrun_works)) {
  TempDir dir("tl-torchrun");
  const auto run = run_torchrun("OMP_NUM_THREADS=1", "", "train", dir.path);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  const auto rank0 = load_params((dir.path / "params0.pt").string());
  const auto rank1 = load_params((dir.path / "params1.pt").string());
  BOOST_TEST(torch::equal(rank0, rank1));  // fit() returned on every rank with the same model
  const double difference = (rank0 - reference_params(2, 1)).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |torchrun ddp - one process| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  BOOST_TEST(fs::exists(dir.path / "result.txt"));  // rank 0 is the main process under torchrun
}

BOOST_AUTO_TEST_CASE(a_killed_rank_ends_every_rank_and_torchrun_fails, *boost::unit_test::precondition(torchrun_works)) {
  TempDir dir("tl-torchrun");
  const auto run = run_torchrun("OMP_NUM_THREADS=1 TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_KILL_AT_STEP=7 "
                                "TL_TEST_CKPT_DIR='" + (dir.path / "ckpt").string() + "'",
                                "--max-restarts 0", "ckpt", dir.path);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code != 0);
  BOOST_TEST(!fs::exists(dir.path / "params0.pt"));  // rank 0 did not finish either
  BOOST_TEST(leftover_workers() == 0);
  BOOST_TEST(fs::exists(dir.path / "ckpt" / "last.ckpt"));  // the checkpoint before the kill is there to resume
}

BOOST_AUTO_TEST_CASE(torchrun_max_restarts_resumes_from_the_newest_checkpoint_bit_for_bit,
                     *boost::unit_test::precondition(torchrun_works)) {
  TempDir dir("tl-torchrun");
  const std::string common = "OMP_NUM_THREADS=1 TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 ";
  fs::create_directories(dir.path / "uninterrupted");
  fs::create_directories(dir.path / "restarted");
  const auto uninterrupted = run_torchrun(common + "TL_TEST_CKPT_DIR='" + (dir.path / "ckpt_full").string() + "'", "",
                                          "ckpt", dir.path / "uninterrupted");
  BOOST_REQUIRE_MESSAGE(uninterrupted.exit_code == 0, uninterrupted.output);
  // Rank 1 is SIGKILLed at step 7 of the first attempt; torchrun restarts both ranks, which find
  // the step-6 checkpoint and continue from it.
  const auto restarted = run_torchrun(common + "TL_TEST_KILL_AT_STEP=7 TL_TEST_CKPT_DIR='" +
                                          (dir.path / "ckpt_killed").string() + "'",
                                      "--max-restarts 1", "ckpt", dir.path / "restarted");
  BOOST_TEST_MESSAGE(restarted.output);
  BOOST_REQUIRE_MESSAGE(restarted.exit_code == 0, restarted.output);
  BOOST_TEST(restarted.output.find("resumed from") != std::string::npos);
  for (const char* params : {"params0.pt", "params1.pt"}) {
    BOOST_TEST(torch::equal(load_params((dir.path / "restarted" / params).string()),
                            load_params((dir.path / "uninterrupted" / params).string())),
               params << " differs between the restarted and the uninterrupted job");
  }
  BOOST_TEST(leftover_workers() == 0);
}
