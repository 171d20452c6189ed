// elastic_recovery: what a lost rank costs a DDP or sharded job (issue 52; --sharding), trainloop's launcher spawning
// --ranks CPU ranks of benchmarks/deep_linear.hpp's DeepLinear with Adam. One job per call;
// benchmarks/run_elastic_recovery.sh interleaves the scenarios and prints the table
// (benchmarks/README.md, "Elastic training").
//
//   elastic_recovery --scenario steady  --elastic 0|1 ...   no rank lost: the step time, and so the
//                                                           cost of elastic training's step commits
//   elastic_recovery --scenario elastic --kill-at K ...     rank R SIGKILLed in step K's forward
//                                                           (TRAINLOOP_TEST_KILL_AT); the survivors go on
//   elastic_recovery --scenario restart --kill-at K --every E ...  the same death without elastic
//                                                           training: max_restarts(1) restarts every rank
//                                                           from the newest checkpoint (one every E steps)
//   elastic_recovery --scenario join --kill-at K ...        as elastic, and the launcher starts a
//                                                           replacement (max_replacements 1), which joins:
//                                                           the time until the job has its size again, and
//                                                           the pause its admission costs the members
//
// The main rank appends "step <global step> <unix time> <world size>" at every step's end to a log;
// the test hook writes the time of the kill into its mark file. After fit() returns, the launching
// process prints one line: the median step time before the death, the time from the death to the
// next step completed and to the first step past the one in flight (progress again), and the steps
// whose work was lost (completed before the death, done again after it).

#include <trainloop/trainloop.hpp>

#include "bench_common.hpp"
#include "deep_linear.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <sys/resource.h>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// Appends every step's end to the log (the main process of each world: rank 0), and rank 0's
/// peak resident set over its whole run (getrusage's ru_maxrss) to `peak` at the fit's end.
struct StepClock : tl::Callback {
  StepClock(std::string log, std::string peak_file) : path(std::move(log)), peak(std::move(peak_file)) {}
  bool main_process_only() const override { return true; }
  void on_step_end(tl::TrainState& state) override {
    std::ofstream(path, std::ios::app) << "step " << state.global_step << ' ' << std::fixed << unix_seconds() << ' '
                                       << state.world_size << '\n';
  }
  void on_fit_end(tl::TrainState&, const tl::History&) override {
    rusage usage{};
    ::getrusage(RUSAGE_SELF, &usage);
    std::ofstream(peak) << static_cast<double>(usage.ru_maxrss) / 1024.0 << '\n';  // KiB on Linux
  }
  std::string path, peak;
};

struct StepLine {
  long step = 0;
  double time = 0.0;
  int world = 0;
};

std::vector<StepLine> read_steps(const std::string& path) {
  std::vector<StepLine> lines;
  std::ifstream in(path);
  std::string word;
  for (StepLine line; in >> word >> line.step >> line.time >> line.world;) lines.push_back(line);
  return lines;
}

using bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"What a lost rank costs a DDP job: elastic training against a restart from the newest checkpoint"};
  std::string scenario = "elastic", dir = "/tmp/trainloop_elastic_recovery", sharding = "none";
  int ranks = 3, kill_rank = 2, elastic_flag = 1;
  int64_t layers = 6, width = 4096, batch_size = 8, steps = 12, kill_at = 6, every = 4;
  app.add_option("--scenario", scenario)->check(CLI::IsMember({"steady", "elastic", "restart", "join"}));
  app.add_option("--elastic", elastic_flag, "steady: elastic training on (1) or off (0)");
  app.add_option("--ranks", ranks, "CPU ranks at the start");
  app.add_option("--kill-rank", kill_rank, "the rank killed (not 0)");
  app.add_option("--kill-at", kill_at, "the step in whose forward it dies");
  app.add_option("--every", every, "restart: a checkpoint every N steps");
  app.add_option("--layers", layers, "hidden width x width layers (6 x 4096: 100.7 M parameters)");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  app.add_option("--steps", steps, "optimizer steps of the epoch at --ranks ranks");
  app.add_option("--sharding", sharding, "none (DDP), optimizer (ZeRO-1), gradients or full (fsdp)")
      ->check(CLI::IsMember({"none", "optimizer", "gradients", "full"}));
  app.add_option("--dir", dir, "work directory (the log, the kill mark, the checkpoints); emptied first");
  CLI11_PARSE(app, argc, argv);
  const bool launching = std::getenv("TRAINLOOP_RANK") == nullptr;
  const std::string log = dir + "/steps.log", mark = dir + "/killed";
  if (launching) {
    fs::remove_all(dir);
    fs::create_directories(dir);
    if (scenario != "steady") {
      const std::string kill = std::to_string(kill_rank) + ":" + std::to_string(kill_at) + ":forward";
      ::setenv("TRAINLOOP_TEST_KILL_AT", kill.c_str(), 1);
      ::setenv("TRAINLOOP_TEST_KILL_MARK", mark.c_str(), 1);
    }
  }
  torch::set_num_threads(1);
  const int64_t samples = ranks * batch_size * steps;
  auto x = torch::randn({samples, width}, at::detail::createCPUGenerator(1));
  auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
  tl::data::TensorDataset train(x, y, 10);
  torch::manual_seed(0);
  DeepLinear net(layers, width, 10);
  int64_t parameters = 0;
  for (const auto& p : net->parameters()) parameters += p.numel();
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-4));
  auto mode = tl::gpu_mode::DistributedDataParallel()
                  .procs_per_node(ranks)
                  .device_type(torch::kCPU)
                  .timeout(std::chrono::seconds(300))
                  .elastic(scenario == "elastic" || scenario == "join" || (scenario == "steady" && elastic_flag != 0))
                  .max_restarts(scenario == "restart" ? 1 : 0)
                  .max_replacements(scenario == "join" ? 1 : 0)  // elastic: the survivors go on alone
                  .zero(sharding == "optimizer");
  tl::gpu_mode::Any chosen = mode;
  if (sharding == "gradients" || sharding == "full") {
    chosen = tl::gpu_mode::FullyShardedDataParallel().processes_like(mode).sharding(tl::distributed::sharding_named(sharding));
  }
  tl::TrainLoop<DeepLinear, tl::gpu_mode::Any> loop(
      net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(batch_size).progress(false),
      chosen);
  tl::CallbackList callbacks{std::make_shared<StepClock>(log, dir + "/peak_rank0")};
  if (scenario == "restart") {
    callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(
        tl::ModelCheckpointOptions(dir + "/checkpoints").every_n_steps(every).keep_last(1)));
  }
  loop.fit(1, callbacks);
  // Only the launching process gets here.
  const std::vector<StepLine> lines = read_steps(log);
  double death = 0.0;
  if (scenario != "steady") std::ifstream(mark) >> death;
  std::vector<double> before;  // step intervals before the death (or all, steady), the first step left out
  long completed_before = 0;
  for (size_t i = 0; i < lines.size(); ++i) {
    if (death > 0.0 && lines[i].time > death) break;
    completed_before = lines[i].step;
    if (i >= 2) before.push_back(lines[i].time - lines[i - 1].time);
  }
  double next_step = 0.0, progress = 0.0;
  long first_after = 0;
  for (const StepLine& line : lines) {
    if (death <= 0.0 || line.time <= death) continue;
    if (next_step == 0.0) {
      next_step = line.time - death;
      first_after = line.step;
    }
    if (line.step > completed_before && progress == 0.0) progress = line.time - death;
  }
  const long lost = death > 0.0 ? completed_before - (first_after - 1) : 0;
  // join: the first step with every rank again, the interval that ends with it (the admission's
  // pause plus that step), and the median step of the smaller world in between.
  double back_to_full = 0.0, join_interval = 0.0;
  std::vector<double> smaller;
  for (size_t i = 1; i < lines.size() && death > 0.0; ++i) {
    if (lines[i].time <= death || back_to_full > 0.0) continue;
    if (lines[i].world == ranks && lines[i - 1].world < ranks) {
      back_to_full = lines[i].time - death;
      join_interval = lines[i].time - lines[i - 1].time;
    } else if (lines[i].world < ranks && lines[i - 1].world < ranks) {
      smaller.push_back(lines[i].time - lines[i - 1].time);
    }
  }
  std::printf("elastic_recovery scenario=%s sharding=%s elastic=%d ranks=%d->%d parameters=%.1fM step_s=%.3f steps_logged=%zu",
              scenario.c_str(), sharding.c_str(), static_cast<int>(mode.elastic()), ranks, lines.empty() ? 0 : lines.back().world,
              static_cast<double>(parameters) / 1e6, median(before), lines.size());
  double peak = 0.0;
  std::ifstream(dir + "/peak_rank0") >> peak;
  std::printf(" rank0_peak_mib=%.0f", peak);
  if (scenario != "steady") {
    std::printf(" killed_in_step=%ld death_to_next_step_s=%.3f death_to_progress_s=%.3f steps_lost=%ld", kill_at,
                next_step, progress, lost);
    if (scenario == "join") {
      std::printf(" death_to_full_size_s=%.3f join_step_interval_s=%.3f smaller_step_s=%.3f", back_to_full, join_interval,
                  median(smaller));
    }
  }
  std::printf("\n");
  return 0;
}
