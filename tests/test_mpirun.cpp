#define BOOST_TEST_MODULE test_mpirun
#include "unit_test.hpp"

// Ranks started by Open MPI's mpirun on one machine join the job without MASTER_ADDR or
// MASTER_PORT (loopback, and a port every rank derives from the job's identity), and train
// what one process trains with the combined batch. Skipped where mpirun is not installed
// (scripts/install-deps.sh installs openmpi-bin).

#include "ddp_test_model.hpp"
#include "test_paths.hpp"
#include "test_support.hpp"

#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>

namespace fs = std::filesystem;

namespace {

bool mpirun_installed() { return std::system("command -v mpirun > /dev/null 2>&1") == 0; }

}  // namespace

BOOST_AUTO_TEST_CASE(ranks_started_by_mpirun_on_one_machine_join_without_master_variables) {
  if (!mpirun_installed()) {
    std::cout << "TRAINLOOP_TEST_SKIPPED: mpirun not found (apt install openmpi-bin)\n";
    return;
  }
  const auto dir = fs::temp_directory_path() / ("trainloop_mpirun_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  // --allow-run-as-root: CI containers run as root; --oversubscribe: two ranks on a machine
  // that may have fewer cores. MASTER_ADDR/MASTER_PORT removed so only the job's identity is left.
  const std::string output = run_command("env -u MASTER_ADDR -u MASTER_PORT mpirun --allow-run-as-root --oversubscribe "
                                         "-np 2 " + test_program("ddp_worker") + " train 2 " + dir.string() + " 2>&1").output;
  BOOST_TEST_MESSAGE(output);
  BOOST_REQUIRE_MESSAGE(fs::exists(dir / "params0.pt") && fs::exists(dir / "params1.pt"), output);
  const auto rank0 = load_params((dir / "params0.pt").string());
  const auto rank1 = load_params((dir / "params1.pt").string());
  BOOST_TEST(torch::equal(rank0, rank1));  // fit() returned on every rank with the same model
  // 2 ranks x batch 4 equal one process with batch 8 (as under torchrun and the own launcher)
  const double difference = (rank0 - reference_params(2, 1)).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |mpirun ddp - one process| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  BOOST_TEST(fs::exists(dir / "result.txt"));  // rank 0 is the main process under mpirun
  fs::remove_all(dir);
}
