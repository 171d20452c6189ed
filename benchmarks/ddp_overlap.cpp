// ddp_overlap: does all-reducing gradient buckets during backward (GradientReducer overlap) make
// a DDP step faster than all-reducing them after backward? 2 CPU ranks (Gloo).
//
//   ddp_overlap --repetitions 3 --layers 6 --width 1024 --batch-size 8 --steps 60 --bucket-cap-mib 2 --first-bucket-cap-mib 1
//   ddp_overlap --comm-hook powersgd:4 ...   # the same, each bucket through a comm hook
//
// The model is a stack of `--layers` width x width linear layers (4 MiB of gradient each at
// width 1024) with a small per-rank batch, so communication is a large share of the step, and the
// bucket caps give one bucket per layer or so: with overlap, the all-reduce of the last layers'
// bucket runs while backward still computes the first layers' gradients.
// Each repetition runs fit() once with overlap(true) and once with overlap(false), alternating
// which goes first (the machine is shared and noisy). fit() runs 2 epochs; the first is a
// warm-up, and step time = last epoch seconds / last epoch steps. Printed: every measurement,
// the median step time of each mode, and the median of the per-repetition ratios
// (no-overlap / overlap; > 1 means overlap is faster).
//
// Each fit() re-executes this program per rank; a rank skips the earlier fit() calls, so the
// printing after the loop happens once, in the launching process.

#include <trainloop/gpu_mode/distributed_data_parallel.hpp>
#include <trainloop/trainloop.hpp>

#include "deep_linear.hpp"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

namespace tl = trainloop;

namespace {
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}
}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainloop DDP: overlapped vs after-backward gradient all-reduce"};
  int repetitions = 3, ranks = 2;
  int64_t layers = 6, width = 1024, batch_size = 8, steps = 60;
  double bucket_cap_mib = 2.0, first_bucket_cap_mib = 1.0;
  std::string comm_hook = "none";
  app.add_option("--repetitions", repetitions, "fit() runs per mode, interleaved");
  app.add_option("--ranks", ranks, "CPU ranks");
  app.add_option("--layers", layers, "hidden width x width layers");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  app.add_option("--steps", steps, "optimizer steps per epoch");
  app.add_option("--bucket-cap-mib", bucket_cap_mib, "cap of every bucket after the first");
  app.add_option("--first-bucket-cap-mib", first_bucket_cap_mib, "cap of the first bucket");
  app.add_option("--comm-hook", comm_hook, "how gradients travel: none, fp16, bf16, powersgd[:RANK]");
  CLI11_PARSE(app, argc, argv);
  try {
    const int64_t samples = static_cast<int64_t>(ranks) * batch_size * steps;
    auto x = torch::randn({samples, width}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
    tl::data::TensorDataset train(x, y, 10);

    std::vector<double> with_overlap, without_overlap, ratios;
    for (int rep = 0; rep < repetitions; ++rep) {
      double step_seconds[2] = {0.0, 0.0};  // [0]: overlap false, [1]: overlap true
      for (int k = 0; k < 2; ++k) {
        const bool overlap = ((rep + k) % 2) == 0;  // rep 0: overlap first; rep 1: no-overlap first
        torch::manual_seed(0);
        DeepLinear net(layers, width, 10);
        torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
        auto mode = tl::gpu_mode::DistributedDataParallel()
                        .procs_per_node(ranks)
                        .device_type(torch::kCPU)
                        .overlap(overlap)
                        .first_bucket_cap_bytes(static_cast<int64_t>(first_bucket_cap_mib * (1 << 20)))
                        .bucket_cap_bytes(static_cast<int64_t>(bucket_cap_mib * (1 << 20)))
                        .comm_hook(tl::distributed::comm_hook_named(comm_hook));
        auto options = tl::TrainLoopOptions().batch_size(batch_size).shuffle(false);
        tl::TrainLoop<DeepLinear, tl::gpu_mode::DistributedDataParallel> loop(
            net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), options, mode);
        auto history = loop.fit(2);
        if (!tl::is_main_process()) continue;  // a spawned rank passing an earlier fit(): only the launcher prints
        const auto& last = history.last();
        const double seconds_per_step = last.seconds / static_cast<double>(last.steps);
        step_seconds[overlap ? 1 : 0] = seconds_per_step;
        std::printf("rep %d overlap=%-5s steps %lld epoch seconds %.4f step seconds %.5f (warm-up epoch %.4f s)\n",
                    rep + 1, overlap ? "true" : "false", static_cast<long long>(last.steps), last.seconds,
                    seconds_per_step, history.epochs.front().seconds);
        std::fflush(stdout);
      }
      with_overlap.push_back(step_seconds[1]);
      without_overlap.push_back(step_seconds[0]);
      ratios.push_back(step_seconds[0] / step_seconds[1]);
    }
    std::printf("median step seconds: overlap=true %.5f  overlap=false %.5f\n", median(with_overlap),
                median(without_overlap));
    std::printf("median ratio (no-overlap / overlap, >1 = overlap faster): %.3f  (goal >= 1.2)\n", median(ratios));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 1;
  }
}
