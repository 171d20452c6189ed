#pragma once
// What the programs that drive ddp_worker share (test_ddp, test_sharding, test_comm_hooks,
// test_equivalence): starting the worker (spawned ranks, or ranks started by hand with torchrun's
// variables) and reading what it wrote, the "ckpt" scenario and its one-process reference, Adam's
// moments in a checkpoint, and the sharding levels as the worker's settings.
// Include after `#define BOOST_TEST_MODULE name`; the worker is test_program("ddp_worker")
// (tests/CMakeLists.txt).

#include "unit_test.hpp"

#include "ddp_test_model.hpp"
#include "test_paths.hpp"
#include "test_support.hpp"

#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/distributed/launch/free_port.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

/// What one ddp_worker job left: its exit status and output, how long it ran, its directory and
/// result.txt's numbers.
struct WorkerRun {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
  fs::path dir;
  std::map<std::string, double> result;
};

/// The collective timeout of ddp_worker's failure scenarios (throw, sigkill, segv, exit0). A job
/// that ends before it ended because the launcher saw the failure, not because a collective gave
/// up: the bound tells those two apart, it is not a speed goal.
constexpr double kFailureTimeoutSeconds = 60;

/// The `key value` lines of a result file written by ddp_worker.
inline std::map<std::string, double> read_result(const fs::path& path) {
  std::map<std::string, double> result;
  std::ifstream in(path);
  std::string key;
  double value;
  while (in >> key >> value) result[key] = value;
  return result;
}

/// Runs ddp_worker (which spawns its ranks) and collects its output and result file.
inline WorkerRun run_worker(const std::string& scenario, int world, int port = 0, const std::string& env = "",
                            const std::string& name = "") {
  WorkerRun run;
  run.dir = fs::temp_directory_path() / ("trainloop_ddp_" + scenario + name + "_" + std::to_string(world) + "_" +
                                         std::to_string(::getpid()));
  fs::remove_all(run.dir);
  fs::create_directories(run.dir / "tmp");
  // The job's temporary files (run directories, kept error texts) go where the test removes them.
  const std::string tmpdir = env.find("TMPDIR=") == std::string::npos ? "TMPDIR=" + (run.dir / "tmp").string() : "";
  const std::string command = tmpdir + " " + env + " " + test_program("ddp_worker") + " " + scenario + " " + std::to_string(world) +
                              " " + run.dir.string() + " " + std::to_string(port) + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  CommandRun job = run_command(command);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.exit_code = job.exit_code;
  run.output = std::move(job.output);
  run.result = read_result(run.dir / "result.txt");
  return run;
}

/// Processes still running this worker binary (none may outlive a job).
inline int leftover_workers() { return processes_running("ddp_worker"); }

/// Runs `ddp_worker scenario` as `world` ranks started by hand with torchrun's variables;
/// returns the combined output once all ended.
inline std::string run_torchrun_style(const std::string& scenario, int world, const fs::path& dir,
                                      const std::string& env = "") {
  const int port = tl::distributed::find_free_port();
  std::string common = env + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
                       " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  std::string command = "(";
  for (int rank = 0; rank < world; ++rank) {
    command += common + "RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) + " " + test_program("ddp_worker") +
               " " + scenario + " " + std::to_string(world) + " " + dir.string() + (rank + 1 < world ? " & " : "; wait");
  }
  command += ") 2>&1";
  return run_command(command).output;
}

/// A fresh directory for one test's files (the caller removes it).
inline fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("trainloop_ddp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// ---- The "ckpt" scenario: 2 ranks of batch 4, shuffled, checkpoints -------------------------------

/// ddp_worker's "ckpt" scenario on 2 ranks with checkpoints in `ckpt_dir` and the given TL_TEST_*
/// settings.
inline WorkerRun run_ckpt(const std::string& name, const fs::path& ckpt_dir, const std::string& settings) {
  return run_worker("ckpt", 2, 0, "TL_TEST_CKPT_DIR=" + ckpt_dir.string() + " " + settings, "_" + name);
}

/// One process with batch 8 and shuffling: what the "ckpt" scenario's 2 ranks of batch 4 do (the
/// same samples in each step, SGD with momentum).
struct ShuffledReference {
  Mlp net;
  torch::optim::SGD optimizer;
  tl::TrainLoop<Mlp> loop;
  ShuffledReference()
      : net((torch::manual_seed(5), Mlp())),
        optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        loop(net, make_data(40, 1), make_data(40, 2), optimizer, torch::nn::CrossEntropyLoss(),
             tl::TrainLoopOptions().batch_size(8).metrics({std::make_shared<tl::Accuracy>()})) {}
};

// ---- Optimizer state in checkpoints, and the sharding levels ----------------------------------

/// Adam's two moments of every parameter a checkpoint holds state for, in parameter order and
/// flattened, and how many parameters have state.
inline std::pair<torch::Tensor, int64_t> adam_moments(const fs::path& file) {
  if (tl::is_sharded_checkpoint(file)) {  // a sharded mode's per-rank checkpoint: the moments by name
    tl::detail::DcpCheckpoint checkpoint(file);
    std::vector<torch::Tensor> moments;
    int64_t with_state = 0;
    Mlp net;
    for (const auto& item : net->named_parameters()) {
      const std::string key = "optim.state." + item.key() + ".";
      if (!checkpoint.has(key + "exp_avg")) continue;
      ++with_state;
      moments.push_back(checkpoint.read_whole(key + "exp_avg").flatten());
      moments.push_back(checkpoint.read_whole(key + "exp_avg_sq").flatten());
    }
    return {moments.empty() ? torch::zeros({0}) : torch::cat(moments), with_state};
  }
  torch::serialize::InputArchive archive, ours, optimizer, groups, group, states;
  archive.load_from(file.string());
  BOOST_REQUIRE(archive.try_read("__trainloop__", ours) && ours.try_read("optimizer", optimizer));
  BOOST_REQUIRE(optimizer.try_read("param_groups", groups) && groups.try_read("param_groups/0", group));
  BOOST_REQUIRE(optimizer.try_read("state", states));
  torch::Tensor size;
  BOOST_REQUIRE(group.try_read("params/size", size));
  std::vector<torch::Tensor> moments;
  int64_t with_state = 0;
  for (int64_t i = 0; i < size.item<int64_t>(); ++i) {
    c10::IValue key;
    torch::serialize::InputArchive state;
    if (!group.try_read("params/" + std::to_string(i), key) || !states.try_read(key.toStringRef(), state)) continue;
    ++with_state;
    torch::Tensor exp_avg, exp_avg_sq;
    state.read("exp_avg", exp_avg);
    state.read("exp_avg_sq", exp_avg_sq);
    moments.push_back(exp_avg.flatten());
    moments.push_back(exp_avg_sq.flatten());
  }
  return {moments.empty() ? torch::zeros({0}) : torch::cat(moments), with_state};
}

constexpr int64_t kMlpParameters = 6 * 16 + 16 + 16 * 16 + 16 + 16 * 3 + 3;  // 435, in 6 tensors

/// The three sharding levels, as ddp_worker's settings, and the elements the rank holding the most
/// keeps state for: level 1 cuts the whole flat space, levels 2 and 3 each unit (fc1 112, fc2 272,
/// fc3 51 elements) in W chunks.
struct LevelCase {
  const char* name;
  const char* settings;
  bool by_unit;
};
constexpr LevelCase kLevels[] = {{"optimizer", "TL_TEST_ZERO=1 ", false},
                                 {"gradients", "TL_TEST_SHARDING=gradients ", true},
                                 {"full", "TL_TEST_SHARDING=full ", true}};
inline int64_t most_owned_elements(const LevelCase& level, int64_t world) {
  auto chunk = [world](int64_t n) { return (n + world - 1) / world; };
  return level.by_unit ? chunk(112) + chunk(272) + chunk(51) : chunk(kMlpParameters);
}
