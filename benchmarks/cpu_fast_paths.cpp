// cpu_fast_paths: how close TrainLoop runs to this CPU's limit, in fp32 and bf16, in contiguous and
// channels-last memory. At start it measures the machine's practical peaks (fp32 sgemm, bf16
// gemm, bf16 and fp32 channels-last 3x3 convolution); then it trains one model in every
// precision x memory-format configuration, interleaved repetition by repetition, and prints per
// configuration the median samples/s with its range, the ratio to fp32 contiguous (median of the
// per-repetition ratios), the achieved GFLOP/s and its fraction of the peak of the precision it
// runs (fp32: sgemm; bf16: bf16 gemm), and the share of the epoch spent waiting for the loader.
//
//   cpu_fast_paths --model fashion --samples 6400 --repetitions 5
//   cpu_fast_paths --model resnet18 --size 64 --batch-size 64 --samples 1280 --repetitions 3
//   cpu_fast_paths --model resnet18 --size 64 --op-profile 25 --profile bf16-channels-last
//
// fashion: the example's CNN (examples/fashion_net.hpp) on a fixed random subset of the real
// Fashion-MNIST training split, Adam 1e-3 (as the example). A zoo name (resnet18, xresnet18, ...):
// synthetic N(0,1) images of --size pixels, 10 classes, SGD 0.01 momentum 0.9. Each measurement
// builds the model from the same seed and fits 2 epochs; the figure is the second (the first
// creates oneDNN's kernels). Threads: trainloop's defaults. --op-profile prints, for one
// configuration, where an epoch's time goes op by op (benchmarks/op_profile.hpp).
//
// Exit status: 0 (a benchmark reports, it does not assert); 1 on errors.

#include "fashion_net.hpp"
#include "flop_count.hpp"
#include "machine_peaks.hpp"
#include "op_profile.hpp"

#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace tl = trainloop;

namespace {

/// One precision x memory-format pair.
struct Config {
  std::string name;
  tl::Precision precision;
  tl::MemoryFormat format;
};

const std::vector<Config>& all_configs() {
  static const std::vector<Config> configs{
      {"fp32-contiguous", tl::Precision::fp32, tl::MemoryFormat::contiguous},
      {"fp32-channels-last", tl::Precision::fp32, tl::MemoryFormat::channels_last},
      {"bf16-contiguous", tl::Precision::bf16, tl::MemoryFormat::contiguous},
      {"bf16-channels-last", tl::Precision::bf16, tl::MemoryFormat::channels_last},
  };
  return configs;
}

/// What one measurement gives.
struct Measurement {
  double samples_per_second = 0.0;
  double data_wait_fraction = 0.0;
  double loss = 0.0;
};

struct Workload {
  std::string model;  // "fashion" or a zoo name
  torch::Tensor inputs, targets;
  int64_t batch_size = 64;
  uint64_t seed = 0;
  bool profile_by_caller = false;  // --op-callers: op profile rows keyed by op and caller
};

/// Builds `model` from the workload's seed.
template <class Model>
Model seeded(const Workload& w) {
  torch::manual_seed(w.seed);
  if constexpr (std::is_same_v<Model, FashionNet>) {
    return FashionNet();
  } else {
    return tl::models::ImageClassifier(w.model, tl::models::ImageModelOptions().num_classes(10));
  }
}

template <class Model>
std::unique_ptr<torch::optim::Optimizer> optimizer_for(Model& net) {
  if constexpr (std::is_same_v<Model, FashionNet>) {
    return std::make_unique<torch::optim::Adam>(net->parameters(), torch::optim::AdamOptions(1e-3));
  } else {
    return std::make_unique<torch::optim::SGD>(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  }
}

/// Fits 2 epochs in `config`; the second epoch's figures.
/// With `profile_rows` > 0 the second epoch runs under the op profiler and its table is printed.
template <class Model>
Measurement measure(const Workload& w, const Config& config, size_t profile_rows = 0) {
  Model net = seeded<Model>(w);
  auto optimizer = optimizer_for(net);
  tl::TrainLoop<Model> loop(net, tl::data::TensorDataset(w.inputs, w.targets, 10), {}, *optimizer,
                            torch::nn::CrossEntropyLoss(),
                            tl::TrainLoopOptions()
                                .batch_size(w.batch_size)
                                .shuffle(false)
                                .seed(w.seed)
                                .precision(config.precision)
                                .memory_format(config.format));
  loop.fit(1);
  std::unique_ptr<bench::OpProfile> scope;
  if (profile_rows > 0) scope = std::make_unique<bench::OpProfile>(w.profile_by_caller ? bench::OpProfile::Key::op_and_caller
                                                                                   : bench::OpProfile::Key::op);
  const auto history = loop.fit(1);
  if (scope) {
    scope->stop();
    const int64_t steps = history.last().steps;
    std::printf("\nop profile, %s, one epoch of %lld steps: %.1f ms per step with the profiler on\n",
                config.name.c_str(), static_cast<long long>(steps), 1e3 * scope->wall_seconds() / steps);
    scope->print(std::cout, profile_rows, steps);
    std::cout.flush();
  }
  const auto& e = history.last();
  return {e.samples_per_second, e.seconds > 0 ? e.data_wait_seconds / e.seconds : 0.0, e.train_loss};
}

/// FLOPs per training sample of the workload's model, and whether `auto` picks channels-last for it.
template <class Model>
std::pair<double, bool> describe(const Workload& w) {
  Model probe = seeded<Model>(w);
  const double flops_per_sample = bench::training_flops_per_sample(probe, w.inputs.narrow(0, 0, 2));
  const bool auto_channels_last = tl::nn::uses_channels_last(tl::MemoryFormat::automatic, *probe);
  std::printf("model %s: %.1f MFLOP per training sample (3x the forward's convolutions and matrix products); "
              "the default memory format (auto) is %s for it\n",
              w.model.c_str(), flops_per_sample / 1e6, auto_channels_last ? "channels-last" : "contiguous");
  return {flops_per_sample, auto_channels_last};
}

/// Where one epoch of `config` spends its time, op by op.
template <class Model>
int profile(const Workload& w, const std::string& config, size_t rows) {
  describe<Model>(w);
  for (const auto& c : all_configs()) {
    if (c.name == config) measure<Model>(w, c, rows);
  }
  return 0;
}

/// Every configuration, interleaved; the table.
template <class Model>
int run(const Workload& w, const std::vector<Config>& configs, int64_t repetitions, const bench::MachinePeaks& peaks) {
  const auto [flops_per_sample, auto_channels_last] = describe<Model>(w);
  std::map<std::string, std::vector<double>> rates, ratios, waits;
  std::printf("\n%4s", "rep");
  for (const auto& c : configs) std::printf("  %20s", c.name.c_str());
  std::printf("   (samples/s)\n");
  for (int64_t rep = 1; rep <= repetitions; ++rep) {
    std::map<std::string, double> this_rep;
    std::vector<Config> order = configs;
    if (rep % 2 == 0) std::reverse(order.begin(), order.end());  // drift favours no configuration
    for (const auto& c : order) {
      const Measurement m = measure<Model>(w, c);
      this_rep[c.name] = m.samples_per_second;
      rates[c.name].push_back(m.samples_per_second);
      waits[c.name].push_back(m.data_wait_fraction);
    }
    std::printf("%4lld", static_cast<long long>(rep));
    for (const auto& c : configs) {
      std::printf("  %20.1f", this_rep[c.name]);
      if (this_rep.count("fp32-contiguous") != 0)
        ratios[c.name].push_back(this_rep[c.name] / this_rep["fp32-contiguous"]);
    }
    std::printf("\n");
    std::fflush(stdout);
  }

  std::printf("\n| configuration | samples/s median [min-max] | vs fp32 contiguous | GFLOP/s | %% of peak | "
              "waiting for data |\n|---|---|---|---|---|---|\n");
  for (const auto& c : configs) {
    const auto& r = rates[c.name];
    const double med = bench::median(r);
    const double gflops = med * flops_per_sample / 1e9;
    const bool bf16 = c.precision == tl::Precision::bf16;
    const double peak = peaks.for_precision(bf16);
    std::printf("| %s%s | %.1f [%.1f-%.1f] | %.2fx | %.1f | %.1f%% of %s %.0f | %.1f%% |\n", c.name.c_str(),
                (c.format == tl::MemoryFormat::channels_last) == auto_channels_last && c.precision == tl::Precision::fp32
                    ? " (fp32 default)"
                    : "",
                med, *std::min_element(r.begin(), r.end()), *std::max_element(r.begin(), r.end()),
                ratios.count(c.name) != 0 ? bench::median(ratios[c.name]) : 0.0, gflops,
                peak > 0 ? 100.0 * gflops / peak : 0.0, bf16 ? "bf16 gemm" : "fp32 sgemm", peak,
                100.0 * bench::median(waits[c.name]));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"TrainLoop in fp32/bf16 x contiguous/channels-last against this CPU's measured peaks"};
  std::string model = "fashion";
  std::string data_dir = tl::data::FashionMNISTOptions().root().string();
  std::string only;
  std::string profile_config = "bf16-channels-last";
  int64_t size = 64, batch_size = 64, samples = 6400, repetitions = 3;
  size_t profile_rows = 0;
  uint64_t seed = 0;
  app.add_option("--model", model, "fashion (the example's CNN on Fashion-MNIST) or a zoo model (resnet18, ...)");
  app.add_option("--data", data_dir, "fashion: directory with the Fashion-MNIST *-idx?-ubyte.gz files");
  app.add_option("--size", size, "zoo models: image size in pixels")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch")->check(CLI::PositiveNumber);
  app.add_option("--samples", samples, "training samples per epoch")->check(CLI::PositiveNumber);
  app.add_option("--repetitions", repetitions, "measurements of each configuration, interleaved")
      ->check(CLI::PositiveNumber);
  app.add_option("--only", only, "measure only this configuration (and fp32-contiguous, the baseline)")
      ->check(CLI::IsMember({"fp32-contiguous", "fp32-channels-last", "bf16-contiguous", "bf16-channels-last"}));
  app.add_option("--op-profile", profile_rows,
                 "instead of timing: one epoch of --profile under libtorch's op observers, this many ops by self time");
  app.add_option("--profile", profile_config, "the configuration --op-profile profiles")
      ->check(CLI::IsMember({"fp32-contiguous", "fp32-channels-last", "bf16-contiguous", "bf16-channels-last"}));
  bool op_callers = false;
  app.add_flag("--op-callers", op_callers, "--op-profile: one row per op and the op that called it");
  app.add_option("--seed", seed, "seed for the data subset and the weights");
  CLI11_PARSE(app, argc, argv);
  try {
    Workload w;
    w.model = model;
    w.batch_size = batch_size;
    w.profile_by_caller = op_callers;
    w.seed = seed;
    if (model == "fashion") {
      auto data = bench::fashion_mnist_subset(data_dir, samples, seed, torch::kCPU);
      w.inputs = data.inputs;
      w.targets = data.targets;
    } else {
      tl::models::architecture_config(model);  // an unknown name: the zoo's error, listing the names
      w.inputs = torch::randn({samples, 3, size, size}, at::detail::createCPUGenerator(seed + 1));
      w.targets = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(seed + 2));
    }
    std::vector<Config> configs;
    for (const auto& c : all_configs()) {
      if (only.empty() || c.name == only || c.name == "fp32-contiguous") configs.push_back(c);
    }

    std::printf("cpu_fast_paths: %s, %d usable cores (flags: %s), training with %d intra-op threads "
                "(trainloop's default)\n",
                bench::cpu_model_name().c_str(), tl::cpu::usable_cpu_count(), bench::cpu_fast_path_flags().c_str(),
                tl::cpu::intra_op_threads_for(1));
    std::printf("native bf16 (oneDNN's AMX/AVX512-BF16 kernels): %s\n", tl::cpu_has_native_bf16() ? "yes" : "no");
    if (profile_rows == 0) {
      const auto peaks = bench::MachinePeaks::measure();
      std::printf("peaks on all cores, best of several: fp32 sgemm %.0f GFLOP/s, bf16 gemm %.0f GFLOP/s, "
                  "3x3 conv 64->64 56x56 channels-last: bf16 %.0f, fp32 %.0f GFLOP/s\n",
                  peaks.fp32_sgemm, peaks.bf16_gemm, peaks.bf16_conv_channels_last, peaks.fp32_conv_channels_last);
      std::printf("%lld samples per epoch, batch %lld, %lld repetitions\n", static_cast<long long>(samples),
                  static_cast<long long>(batch_size), static_cast<long long>(repetitions));
      return model == "fashion" ? run<FashionNet>(w, configs, repetitions, peaks)
                                : run<tl::models::ImageClassifier>(w, configs, repetitions, peaks);
    }
    return model == "fashion" ? profile<FashionNet>(w, profile_config, profile_rows)
                              : profile<tl::models::ImageClassifier>(w, profile_config, profile_rows);
  } catch (const c10::Error& e) {
    std::cerr << "cpu_fast_paths: " << e.what_without_backtrace() << '\n';
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "cpu_fast_paths: " << e.what() << '\n';
    return 1;
  }
}
