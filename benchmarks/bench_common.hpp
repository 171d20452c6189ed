#pragma once
/// @file
/// @brief Pieces shared by the benchmarks: order statistics, the Fashion-MNIST subset, the wide
/// MLP whose gradients make communication dominate, and the hand-written libtorch loop that
/// TrainLoop is measured against.

#include <trainloop/detail/cpuinfo.hpp>
#include <trainloop/trainloop.hpp>

#include <torch/cuda.h>
#include <torch/torch.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <chrono>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace bench {

/// @brief The median of `values` (the mean of the two middle ones for an even count); 0 when empty.
inline double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 == 1 ? values[m] : 0.5 * (values[m - 1] + values[m]);
}

/// @brief The `p`-th percentile (0..100) of `values`, interpolated linearly between the closest
/// ranks (NumPy's default); 0 when empty.
inline double percentile(std::vector<double> values, double p) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const double position = std::clamp(p, 0.0, 100.0) / 100.0 * static_cast<double>(values.size() - 1);
  const auto below = static_cast<size_t>(std::floor(position));
  const size_t above = std::min(below + 1, values.size() - 1);
  const double fraction = position - static_cast<double>(below);
  return values[below] + fraction * (values[above] - values[below]);
}

/// @brief Inputs and targets of one workload, on one device.
struct TensorPair {
  torch::Tensor inputs;
  torch::Tensor targets;
};

/// @brief A fixed random subset of `samples` images of the real Fashion-MNIST training split,
/// stored in that random order (so no loop needs to shuffle): inputs (N, 1, 28, 28) float,
/// targets (N) int64, both on `device`. The same seed gives the same subset in every process.
/// @throws trainloop::Error when `samples` is not in [1, 60000] or the files are missing.
inline TensorPair fashion_mnist_subset(const std::string& data_dir, int64_t samples, uint64_t seed,
                                       const torch::Device& device) {
  using trainloop::data::FashionMNIST;
  FashionMNIST train(FashionMNIST::Split::Train, data_dir);
  const int64_t available = train.inputs().size(0);
  TRAINLOOP_CHECK(samples >= 1 && samples <= available, "--samples is ", samples, "; expected 1 to ", available,
                  " (the size of the Fashion-MNIST training split)");
  auto generator = at::detail::createCPUGenerator(seed);
  const auto pick = torch::randperm(available, generator, torch::kLong).narrow(0, 0, samples);
  return {train.inputs().index_select(0, pick).contiguous().to(device),
          train.targets().index_select(0, pick).contiguous().to(device)};
}

/// @brief Synthetic MLP data: `samples` rows of 784 N(0,1) features and labels in [0, 10), drawn
/// from their own generators (the same in every process, whatever ran before).
inline TensorPair synthetic_mlp_data(int64_t samples, uint64_t seed, const torch::Device& device) {
  auto x = torch::randn({samples, 784}, at::detail::createCPUGenerator(seed + 1));
  auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(seed + 2));
  return {x.to(device), y.to(device)};
}

/// @brief The shape of WideMlp: hidden width and number of hidden layers. Process-wide, so the
/// default-constructible module (DataParallel replicas, DDP ranks re-running main) picks it up;
/// set it from the command line before building a model.
struct MlpShape {
  int64_t width = 1024;        ///< units per hidden layer
  int64_t hidden_layers = 2;   ///< hidden Linear+ReLU layers
  /// Multiply-adds of one forward pass per sample (784 inputs, 10 classes, biases ignored).
  int64_t forward_macs() const { return 784 * width + (hidden_layers - 1) * width * width + width * 10; }
  /// FLOPs of one training step per sample: forward 2 x MACs, backward twice the forward.
  double training_flops_per_sample() const { return 6.0 * static_cast<double>(forward_macs()); }
};
inline MlpShape& mlp_shape() {
  static MlpShape shape;
  return shape;
}

/// @brief A wide MLP 784 -> width (x hidden_layers, ReLU) -> 10; by default 784 -> 1024 -> 1024
/// -> 10, ~1.86 M parameters: 7.5 MB of gradients per step against little compute, so gradient
/// communication is a large share of a step. Its shape is mlp_shape().
struct WideMlpImpl : torch::nn::Module {
  WideMlpImpl() {
    const MlpShape shape = mlp_shape();
    int64_t inputs = 784;
    for (int64_t i = 0; i < shape.hidden_layers; ++i) {
      layers->push_back(torch::nn::Linear(inputs, shape.width));
      layers->push_back(torch::nn::ReLU());
      inputs = shape.width;
    }
    layers->push_back(torch::nn::Linear(inputs, 10));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) { return layers->forward(x); }
  torch::nn::Sequential layers;
};
TORCH_MODULE(WideMlp);

/// @brief FLOPs of one training step per sample of examples/fashion_net.hpp's CNN: forward
/// multiply-adds (conv1 28x28x32x9, conv2 14x14x64x32x9, fc1 3136x128, fc2 128x10) x 2 FLOPs,
/// and the backward pass twice the forward: 25.4 MFLOP.
inline double fashion_net_training_flops() {
  const double macs = 28.0 * 28 * 32 * 9 + 14.0 * 14 * 64 * 32 * 9 + 64.0 * 7 * 7 * 128 + 128.0 * 10;
  return 6.0 * macs;
}

/// @brief FLOPs one core issues per cycle at most (fp32 fused multiply-adds), from the CPU's
/// vector units: 32 with AVX2+FMA (two 256-bit FMA pipes, 8 fp32 lanes x 2 FLOPs each: Zen 4,
/// and most x86 cores since Haswell; Intel's server cores with two 512-bit units reach 64, which
/// --peak-gflops can say), 8 without FMA.
inline int fp32_flops_per_cycle() {
  const std::string& cpuinfo = trainloop::detail::cpuinfo_text();
  return trainloop::detail::cpuinfo_has_flag(cpuinfo, "fma") && trainloop::detail::cpuinfo_has_flag(cpuinfo, "avx2") ? 32 : 8;
}

/// @brief The highest clock of core 0, in GHz (cpufreq's maximum, else /proc/cpuinfo's current).
inline double cpu_ghz() {
  std::ifstream max_khz("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq");
  double khz = 0;
  if (max_khz >> khz && khz > 0) return khz / 1e6;
  const std::string mhz = trainloop::detail::cpuinfo_value(trainloop::detail::cpuinfo_text(), "cpu MHz");
  return mhz.empty() ? 0.0 : std::stod(mhz) / 1e3;
}

/// @brief The usable cores' fp32 FMA peak in GFLOP/s from the reported clock: cores x GHz x
/// FLOPs per cycle. On a VM the reported clock is often the nominal one (2.1 GHz here) while the
/// cores run boosted: cpu_sgemm_gflops() measures what they really do.
inline double cpu_nominal_peak_gflops() {
  return trainloop::cpu::usable_cpu_count() * cpu_ghz() * fp32_flops_per_cycle();
}

/// @brief The fp32 rate a large matrix product reaches on every usable core (2048^3, best of 8
/// after a warm-up, OpenBLAS and libtorch given all cores meanwhile): the practical peak the
/// benchmarks' "% peak" is relative to. Measured here: 203 GFLOP/s on 2 Zen 4 cores, i.e. about
/// 3.2 GHz x 32 FLOP/cycle x 2, against a nominal-clock estimate of 134.
inline double cpu_sgemm_gflops() {
  static const double measured = [] {
    const int cores = trainloop::cpu::usable_cpu_count();
    const int threads_before = at::get_num_threads();
    const auto& blas = trainloop::detail::OpenBlasThreads::loaded();
    const int blas_before = blas.get();
    at::set_num_threads(cores);
    blas.set(cores);
    const auto a = torch::randn({2048, 2048});
    const auto b = torch::randn({2048, 2048});
    for (int i = 0; i < 2; ++i) torch::mm(a, b);
    double best = 0.0;
    for (int i = 0; i < 8; ++i) {
      const auto start = std::chrono::steady_clock::now();
      torch::mm(a, b);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      best = std::max(best, 2.0 * 2048.0 * 2048.0 * 2048.0 / seconds / 1e9);
    }
    at::set_num_threads(threads_before);
    if (blas_before > 0) blas.set(blas_before);
    return best;
  }();
  return measured;
}

/// @brief What the peak figures are, for the benchmarks' output.
inline std::string cpu_peak_assumption() {
  std::ostringstream text;
  text << "measured sgemm on " << trainloop::cpu::usable_cpu_count() << " cores; nominal estimate "
       << cpu_nominal_peak_gflops() << " = " << trainloop::cpu::usable_cpu_count() << " cores x " << cpu_ghz()
       << " GHz x " << fp32_flops_per_cycle() << " FLOP/cycle";
  return text.str();
}

/// @brief "2 intra-op, OpenBLAS 1": the threads this process computes with now.
inline std::string thread_description(int intra_op) {
  const int blas = trainloop::detail::OpenBlasThreads::loaded().get();
  return std::to_string(intra_op) + " intra-op, OpenBLAS " + (blas > 0 ? std::to_string(blas) : std::string("n/a"));
}

/// @brief Waits for queued device work, so a host timestamp means the work is done (CUDA only).
inline void wait_for_device(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

/// @brief What one pass of the hand-written loop measured.
struct HandPass {
  double seconds = 0.0;             ///< wall time of the pass
  int64_t samples = 0;              ///< samples trained on
  double mean_loss = 0.0;           ///< mean training loss per sample
  std::vector<double> step_seconds;  ///< wall time of each step (batch slicing to optimizer step)
  double samples_per_second() const { return seconds > 0 ? static_cast<double>(samples) / seconds : 0.0; }
};

/// @brief The loop a competent libtorch user writes by hand, as the baseline: contiguous batches
/// by narrow() (views, no copy), cross-entropy, one optimizer step per batch, the loss summed on
/// the device and read once at the end. The model must already be on the tensors' device.
/// @param max_batches batches to run; < 0 for one whole pass over `data`.
template <class Model>
HandPass hand_written_pass(Model& net, torch::optim::Optimizer& optimizer, const TensorPair& data, int64_t batch_size,
                           int64_t max_batches = -1) {
  using Clock = std::chrono::steady_clock;
  const torch::Device device = data.inputs.device();
  const int64_t n = data.inputs.size(0);
  const int64_t batches = (n + batch_size - 1) / batch_size;
  const int64_t run_batches = max_batches < 0 ? batches : std::min(batches, max_batches);
  HandPass pass;
  pass.step_seconds.reserve(static_cast<size_t>(run_batches));

  net->train();
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
  const auto start = Clock::now();
  auto step_start = start;
  for (int64_t b = 0; b < run_batches; ++b) {
    const int64_t first = b * batch_size;
    const int64_t count = std::min(batch_size, n - first);
    auto input = data.inputs.narrow(0, first, count);
    auto target = data.targets.narrow(0, first, count);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(input), target);
    loss.backward();
    optimizer.step();
    loss_sum += loss.detach() * static_cast<double>(count);
    pass.samples += count;
    wait_for_device(device);
    const auto now = Clock::now();
    pass.step_seconds.push_back(std::chrono::duration<double>(now - step_start).count());
    step_start = now;
  }
  pass.mean_loss = loss_sum.item<double>() / static_cast<double>(std::max<int64_t>(1, pass.samples));
  pass.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  return pass;
}

}  // namespace bench
