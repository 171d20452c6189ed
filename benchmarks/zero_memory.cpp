// zero_memory: peak memory per rank of DDP with gradients copied into buckets, DDP with gradients
// as bucket views (the default) and the three sharding levels (optimizer = ZeRO-1, DDP's zero();
// gradients = ZeRO-2 and full = ZeRO-3, gpu_mode::FullyShardedDataParallel, units the model's 7
// layers), for a ~100 M-parameter MLP trained with Adam, 2 CPU ranks (Gloo).
//
//   zero_memory --repetitions 2 --layers 6 --width 4096 --batch-size 8 --steps 4
//
// Each fit() re-executes this program once per rank, so every fit's ranks are fresh processes and
// their peak resident set (getrusage ru_maxrss) is that fit's alone — but ranks of a later fit()
// pass the earlier ones by loading their states, which raises their baseline: for figures to
// compare, run one configuration per program (--config), as benchmarks/run_zero_memory.sh does,
// interleaved. Each rank writes its peak and its resident set when training began to --out; the
// launching process prints them. Repetitions rotate which configuration goes first. Also printed: the optimizer-state bytes the loop reports
// (EpochRecord::optimizer_state_bytes, the rank holding the most) and the step time.
// On CUDA the allocator's peak would be the figure to compare; this benchmark measures the CPU.

#include <trainloop/trainloop.hpp>

#include "deep_linear.hpp"

#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

namespace tl = trainloop;

namespace {

/// This process's resident set now, in MiB (/proc/self/statm's second field, in pages).
double resident_mib() {
  std::ifstream statm("/proc/self/statm");
  long long size = 0, resident = 0;
  statm >> size >> resident;
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

/// This process's peak resident set so far, in MiB.
double peak_resident_mib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
}

/// In every rank: the resident set when training begins, the peak over the training steps (read
/// at the last step's end) and the peak at the fit's end, into `<dir>/<label>_rank<r>.txt`. The two
/// peaks differ where the epoch's end holds more than a step: full sharding gathers every unit
/// whole for on_epoch_end and on_fit_end (callbacks may read the weights), as for evaluation.
struct RecordMemory : tl::Callback {
  RecordMemory(std::filesystem::path dir, std::string label) : dir(std::move(dir)), label(std::move(label)) {}
  bool main_process_only() const override { return false; }
  void on_fit_begin(tl::TrainState&) override { at_begin = resident_mib(); }
  void on_step_end(tl::TrainState&) override { steps_peak = peak_resident_mib(); }
  void on_fit_end(tl::TrainState& state, const tl::History&) override {
    std::ofstream(dir / (label + "_rank" + std::to_string(state.rank) + ".txt"))
        << at_begin << ' ' << steps_peak << ' ' << peak_resident_mib() << '\n';
  }
  double steps_peak = 0.0;
  std::filesystem::path dir;
  std::string label;
  double at_begin = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainloop DDP (gradient copies, bucket views) vs ZeRO-1/2/3: peak memory per rank, ~100 M-parameter MLP, Adam"};
  int repetitions = 2, ranks = 2;
  int64_t layers = 6, width = 4096, batch_size = 8, steps = 4;
  std::string out = "/tmp/trainloop_zero_memory";
  app.add_option("--repetitions", repetitions, "fit() runs per mode, interleaved");
  app.add_option("--ranks", ranks, "CPU ranks");
  app.add_option("--layers", layers, "hidden width x width layers");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  app.add_option("--steps", steps, "optimizer steps");
  app.add_option("--out", out, "directory for the ranks' memory records");
  std::string config_only = "all";
  app.add_option("--config", config_only, "one configuration only (a fresh launcher per run: what run_zero_memory.sh does)")
      ->check(CLI::IsMember({"all", "ddp-copies", "ddp", "optimizer", "gradients", "full"}));
  CLI11_PARSE(app, argc, argv);
  try {
    std::filesystem::create_directories(out);
    const int64_t samples = static_cast<int64_t>(ranks) * batch_size * steps;
    auto x = torch::randn({samples, width}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
    tl::data::TensorDataset train(x, y, 10);
    // ddp-copies: gradients copied into and out of the buckets (PyTorch DDP's default);
    // ddp: gradients as bucket views (trainloop's default); optimizer, gradients, full: the
    // sharding levels (ZeRO-1, -2, -3).
    std::vector<std::string> configs{"ddp-copies", "ddp", "optimizer", "gradients", "full"};
    if (config_only != "all") configs = {config_only};
    for (int rep = 0; rep < repetitions; ++rep) {
      for (size_t k = 0; k < configs.size(); ++k) {
        const std::string& config = configs[(static_cast<size_t>(rep) + k) % configs.size()];  // rotated per repetition
        const tl::distributed::Sharding sharding =
            config.rfind("ddp", 0) == 0 ? tl::distributed::Sharding::None : tl::distributed::sharding_named(config);
        const std::string label = config + "_rep" + std::to_string(rep + 1);
        torch::manual_seed(0);
        DeepLinear net(layers, width, 10);
        int64_t parameters = 0;
        for (const auto& p : net->parameters()) parameters += p.numel();
        torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-4));
        tl::gpu_mode::Any mode = tl::gpu_mode::DistributedDataParallel()
                                     .procs_per_node(ranks)
                                     .device_type(torch::kCPU)
                                     .zero(sharding == tl::distributed::Sharding::Optimizer)
                                     .gradient_as_bucket_view(config != "ddp-copies");
        if (sharding >= tl::distributed::Sharding::Gradients) {
          mode = tl::gpu_mode::FullyShardedDataParallel().procs_per_node(ranks).device_type(torch::kCPU).sharding(sharding);
        }
        tl::TrainLoop<DeepLinear, tl::gpu_mode::Any> loop(
            net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(batch_size), mode);
        auto history = loop.fit(1, {std::make_shared<RecordMemory>(out, label)});
        if (!tl::is_main_process()) continue;  // a spawned rank passing an earlier fit(): only the launcher prints
        const auto& last = history.last();
        std::printf("rep %d %-10s parameters %lld, optimizer state per rank %lld bytes, %.3f s per step\n", rep + 1,
                    config.c_str(), static_cast<long long>(parameters),
                    static_cast<long long>(last.optimizer_state_bytes), last.seconds / static_cast<double>(last.steps));
        for (int r = 0; r < ranks; ++r) {
          std::ifstream in(std::filesystem::path(out) / (label + "_rank" + std::to_string(r) + ".txt"));
          double at_begin = 0.0, steps_peak = 0.0, peak = 0.0;
          in >> at_begin >> steps_peak >> peak;
          std::printf("  rank %d: resident at fit begin %.0f MiB, peak over the steps %.0f MiB, peak at fit end %.0f MiB\n",
                      r, at_begin, steps_peak, peak);
        }
        std::fflush(stdout);
      }
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 1;
  }
}
