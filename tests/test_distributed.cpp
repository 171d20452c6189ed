#define BOOST_TEST_MODULE test_distributed
#include "unit_test.hpp"

#include "ddp_test_model.hpp"

#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

namespace tl = trainloop;
namespace fs = std::filesystem;

struct WorkerRun {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
  fs::path dir;
  std::map<std::string, double> result;
};

/// Runs ddp_worker (which spawns its ranks) and collects its output and result file.
WorkerRun run_worker(const std::string& scenario, int world, int port = 0, const std::string& env = "") {
  WorkerRun run;
  run.dir = fs::temp_directory_path() / ("trainloop_ddp_" + scenario + "_" + std::to_string(world) + "_" +
                                         std::to_string(::getpid()));
  fs::remove_all(run.dir);
  fs::create_directories(run.dir);
  std::string command = env + " " + DDP_WORKER_PATH + " " + scenario + " " + std::to_string(world) + " " +
                        run.dir.string() + " " + std::to_string(port) + " 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = ::popen(command.c_str(), "r");
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) run.output.append(buffer.data(), n);
  int status = ::pclose(pipe);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(run.dir / "result.txt");
  std::string key;
  double value;
  while (in >> key >> value) run.result[key] = value;
  return run;
}

/// Processes still running this worker binary (none may outlive a job).
int leftover_workers() {
  int count = 0;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    std::error_code ec;
    auto exe = fs::read_symlink(entry.path() / "exe", ec);
    if (!ec && exe.filename() == "ddp_worker") ++count;
  }
  return count;
}

BOOST_AUTO_TEST_CASE(ddp_matches_one_process_with_the_combined_batch) {
  for (int world : {2, 3}) {
    auto run = run_worker("train", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(world, 1)).abs().max().item<double>();
    BOOST_TEST_MESSAGE("world " << world << ": max |ddp - single| = " << difference);
    BOOST_TEST(difference <= 1e-5);
    BOOST_TEST(run.result["steps"] == 5);
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(ddp_with_gradient_accumulation_matches_one_process) {
  for (int world : {2, 3}) {
    auto run = run_worker("accumulate", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(world, 2)).abs().max().item<double>();
    BOOST_TEST_MESSAGE("world " << world << " accumulation 2: max |ddp - single| = " << difference);
    BOOST_TEST(difference <= 1e-5);
    BOOST_TEST(run.result["steps"] == 5);
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(a_second_fit_continues_from_the_first) {
  auto run = run_worker("twofits", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(2, 1, 2)).abs().max().item<double>();
  BOOST_TEST_MESSAGE("two fits: max |ddp - single| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  BOOST_TEST(run.result["steps"] == 10);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(validation_counts_every_sample_once) {
  for (const std::string scenario : {"eval97", "eval99"}) {
    for (int world : {2, 3}) {
      auto run = run_worker(scenario, world);
      BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
      const double n = scenario == "eval97" ? 97 : 99;
      BOOST_TEST_MESSAGE(scenario << " world " << world << ": val loss " << run.result["val_loss"] << " vs "
                                  << run.result["local_val_loss"]);
      BOOST_TEST(run.result["val_samples"] == n);
      BOOST_TEST(std::abs(run.result["val_loss"] - run.result["local_val_loss"]) <= 1e-6);
      BOOST_TEST(std::abs(run.result["val_accuracy"] - run.result["local_val_accuracy"]) <= 1e-6);
      // Training shards are padded: every rank runs ceil(n / world) samples.
      BOOST_TEST(run.result["train_samples"] == std::ceil(n / world) * world);
      fs::remove_all(run.dir);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_rank_that_throws_ends_the_job_with_its_error) {
  auto run = run_worker("throw", 3);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.seconds < 15);
  BOOST_TEST(run.output.find("rank 1") != std::string::npos);
  BOOST_TEST(run.output.find("rank one gave up in epoch 2") != std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_rank_killed_mid_epoch_ends_the_job) {
  auto run = run_worker("sigkill", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.seconds < 15);
  BOOST_TEST(run.output.find("rank 1") != std::string::npos);
  BOOST_TEST(run.output.find("SIGKILL") != std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_master_port_in_use_is_a_clear_error) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  BOOST_REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  BOOST_REQUIRE(::listen(fd, 1) == 0);
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  auto run = run_worker("train", 2, port);
  ::close(fd);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.output.find(std::to_string(port)) != std::string::npos);
  BOOST_TEST(run.output.find("in use") != std::string::npos);
  BOOST_TEST(run.seconds < 15);
}

BOOST_AUTO_TEST_CASE(ranks_started_by_hand_with_torchrun_variables_join_the_job) {
  // Two processes started the way torchrun starts them; each one's fit() returns.
  const int port = tl::dist::find_free_port();
  auto dir = fs::temp_directory_path() / ("trainloop_ddp_join_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string common = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  std::string command = "(" + common + "RANK=0 LOCAL_RANK=0 " + DDP_WORKER_PATH + " train 2 " + dir.string() + " & " +
                        common + "RANK=1 LOCAL_RANK=1 " + DDP_WORKER_PATH + " train 2 " + dir.string() +
                        "; wait) 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  ::pclose(pipe);
  BOOST_TEST_MESSAGE(output);
  BOOST_REQUIRE(fs::exists(dir / "params0.pt"));
  BOOST_REQUIRE(fs::exists(dir / "params1.pt"));
  auto rank0 = load_params((dir / "params0.pt").string());
  auto rank1 = load_params((dir / "params1.pt").string());
  BOOST_TEST(torch::equal(rank0, rank1));  // every rank holds the same model
  BOOST_TEST((rank0 - reference_params(2, 1)).abs().max().item<double>() <= 1e-5);
  BOOST_TEST(fs::exists(dir / "result.txt"));  // written by rank 0, the main process under torchrun
  fs::remove_all(dir);
}
