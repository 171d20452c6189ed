// checkpoint_stall: how long training waits for a checkpoint (issue 53), trainloop's launcher
// spawning 2 CPU ranks of benchmarks/deep_linear.hpp's DeepLinear (6 x 4096: 100.7 M parameters)
// with Adam, a ModelCheckpoint every --every steps. One job per call;
// benchmarks/run_checkpoint_stall.sh interleaves jobs with and without checkpoints at each level
// and prints the table (benchmarks/README.md, "Checkpoints behind training").
//
//   checkpoint_stall --level none|optimizer|gradients|full --every K --steps N --dir D
//                    [--checkpoints 0|1] [--background 0|1]
//
// Levels: none is plain DDP (rank 0 writes one file), optimizer DDP's ZeRO-1, gradients and full
// fsdp's ZeRO-2 and ZeRO-3; the sharded levels write per-rank checkpoints; each is written behind
// training unless --background 0 (none's one file too, since 2026-11-29: it is over 16 MiB). The checkpoints are left in D/checkpoints (keep_last 1). Output, one line from
// the launching process:
//   checkpoint_stall level=L checkpoints=C background=B steps=N every=K step_s=<median step time>
//   mean_step_s=<mean> blocking_ms=<median per checkpoint> blocking_min_ms= blocking_max_ms=
//   written_s=<median, start to the step boundary where the ranks agreed it was committed>
// where blocking is ModelCheckpoint::reports()' blocked_seconds on rank 0: the time its training
// thread waited because of each checkpoint.

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
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

/// Rank 0: every step's end into the log, and at the end what each checkpoint cost.
struct StallLog : tl::Callback {
  StallLog(std::string directory, std::shared_ptr<tl::ModelCheckpoint> watched)
      : dir(std::move(directory)), checkpoints(std::move(watched)) {}
  bool main_process_only() const override { return true; }
  void on_step_end(tl::TrainState&) override {
    std::ofstream(dir + "/steps.log", std::ios::app) << std::fixed << unix_seconds() << '\n';
  }
  void on_fit_end(tl::TrainState&, const tl::History&) override {
    if (!checkpoints) return;
    std::ofstream out(dir + "/reports.log");
    for (const tl::CheckpointReport& report : checkpoints->reports()) {
      out << report.blocked_seconds << ' ' << report.seconds << ' ' << (report.error ? 1 : 0) << ' ' << report.background << '\n';
    }
  }
  std::string dir;
  std::shared_ptr<tl::ModelCheckpoint> checkpoints;
};

using bench::median;

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"How long training waits for a checkpoint: ~100 M-parameter MLP, Adam, 2 CPU ranks"};
  std::string level = "full", dir = "/tmp/trainloop_checkpoint_stall";
  int checkpoints_flag = 1, background = 1, ranks = 2;
  int64_t layers = 6, width = 4096, batch_size = 8, steps = 16, every = 4;
  app.add_option("--level", level, "none (plain DDP), optimizer (ZeRO-1), gradients (ZeRO-2), full (ZeRO-3)")
      ->check(CLI::IsMember({"none", "optimizer", "gradients", "full"}));
  app.add_option("--every", every, "a checkpoint every K optimizer steps");
  app.add_option("--steps", steps, "optimizer steps of the job");
  app.add_option("--dir", dir, "work directory (the logs; the checkpoints in <dir>/checkpoints); emptied first");
  app.add_option("--checkpoints", checkpoints_flag, "1: a ModelCheckpoint every K steps; 0: none (the baseline)");
  app.add_option("--background", background, "1: checkpoints behind training (the default); 0: training waits");
  app.add_option("--ranks", ranks, "CPU ranks");
  app.add_option("--layers", layers, "hidden width x width layers (6 x 4096: 100.7 M parameters)");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  CLI11_PARSE(app, argc, argv);
  if (std::getenv("TRAINLOOP_RANK") == nullptr) {  // the launching process
    fs::remove_all(dir);
    fs::create_directories(dir);
  }
  torch::set_num_threads(1);
  const int64_t samples = ranks * batch_size * steps;
  auto x = torch::randn({samples, width}, at::detail::createCPUGenerator(1));
  auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
  tl::data::TensorDataset train(x, y, 10);
  torch::manual_seed(0);
  DeepLinear net(layers, width, 10);
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-4));
  tl::ModeFlags flags;
  flags.gpu_mode = "ddp";
  flags.procs = ranks;
  flags.sharding = level;  // none: plain DDP; optimizer: ZeRO-1; gradients, full: fsdp
  const tl::gpu_mode::Any mode = tl::mode_from_flags(flags);
  tl::TrainLoop<DeepLinear, tl::gpu_mode::Any> loop(
      net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(batch_size).progress(false),
      mode);
  std::shared_ptr<tl::ModelCheckpoint> checkpoints;
  if (checkpoints_flag != 0) {
    checkpoints = std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir + "/checkpoints")
                                                            .every_n_epochs(0)
                                                            .every_n_steps(every)
                                                            .keep_last(1)
                                                            .in_background(background != 0));
  }
  tl::CallbackList callbacks{std::make_shared<StallLog>(dir, checkpoints)};
  if (checkpoints) callbacks.push_back(checkpoints);
  loop.fit(1, callbacks);
  // Only the launching process gets here.
  std::vector<double> ends, intervals, blocked, written;
  std::ifstream steps_log(dir + "/steps.log");
  for (double t; steps_log >> t;) ends.push_back(t);
  for (size_t i = 2; i < ends.size(); ++i) intervals.push_back(ends[i] - ends[i - 1]);  // the first two warm up
  std::ifstream reports(dir + "/reports.log");
  int failed = 0;
  for (double b, s; reports >> b >> s;) {
    int error = 0, in_background = 0;
    reports >> error >> in_background;
    blocked.push_back(b * 1e3);
    written.push_back(s);
    failed += error;
  }
  const double mean = intervals.empty() ? 0.0 : std::accumulate(intervals.begin(), intervals.end(), 0.0) / static_cast<double>(intervals.size());
  std::printf("checkpoint_stall level=%s checkpoints=%d background=%d steps=%zu every=%ld step_s=%.3f mean_step_s=%.3f",
              level.c_str(), checkpoints_flag, background, ends.size(), static_cast<long>(every), median(intervals), mean);
  if (!blocked.empty()) {
    std::printf(" checkpoints_written=%zu failed=%d blocking_ms=%.1f blocking_min_ms=%.1f blocking_max_ms=%.1f written_s=%.3f",
                blocked.size(), failed, median(blocked), *std::min_element(blocked.begin(), blocked.end()),
                *std::max_element(blocked.begin(), blocked.end()), median(written));
  }
  std::printf("\n");
  return 0;
}
