// machine_peaks.hpp: this machine's practical peaks, measured at start, so a benchmark can say how
// close a model runs to what the hardware does here (and not to a datasheet figure the VM's
// cores never reach): fp32 sgemm, bf16 gemm, and a bf16 channels-last 3x3 convolution (the
// kernel a convolutional network's bf16 step is made of; oneDNN's AMX/AVX512-BF16 path).
#pragma once

#include "bench_common.hpp"

#include <trainloop/cpu/threads.hpp>
#include <trainloop/detail/cpuinfo.hpp>
#include <trainloop/precision/native_bf16.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <string>

namespace bench {

/// @brief The best rate of `work_flops` per call of `run` over `trials` timed calls after
/// `warmup` untimed ones, with libtorch given every usable core meanwhile. GFLOP/s.
template <class Run>
double best_gflops(double work_flops, Run&& run, int warmup = 2, int trials = 8) {
  const int threads_before = at::get_num_threads();
  at::set_num_threads(trainloop::cpu::usable_cpu_count());
  for (int i = 0; i < warmup; ++i) run();
  double best = 0.0;
  for (int i = 0; i < trials; ++i) {
    const auto start = std::chrono::steady_clock::now();
    run();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    best = std::max(best, work_flops / seconds / 1e9);
  }
  at::set_num_threads(threads_before);
  return best;
}

/// @brief bf16 matrix product 2048^3 (oneDNN's bf16 gemm where the CPU has the instructions;
/// libtorch's emulation otherwise). GFLOP/s.
inline double cpu_bf16_gemm_gflops() {
  static const double measured = [] {
    const auto a = torch::randn({2048, 2048}).to(torch::kBFloat16);
    const auto b = torch::randn({2048, 2048}).to(torch::kBFloat16);
    return best_gflops(2.0 * 2048 * 2048 * 2048, [&] { torch::mm(a, b); });
  }();
  return measured;
}

/// @brief 3x3 convolution 64 -> 64 channels at 56x56, batch 32, forward, in `dtype` and
/// channels-last or contiguous memory: ResNet's most common layer. GFLOP/s.
inline double cpu_conv3x3_gflops(torch::ScalarType dtype, bool channels_last) {
  const auto format = channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  const auto x = torch::randn({32, 64, 56, 56}).to(dtype).contiguous(format);
  const auto w = torch::randn({64, 64, 3, 3}).to(dtype).contiguous(format);
  torch::NoGradGuard no_grad;
  return best_gflops(2.0 * 32 * 64 * 56 * 56 * 64 * 9,
                     [&] { torch::conv2d(x, w, {}, /*stride=*/1, /*padding=*/1); }, 2, 5);
}

/// @brief The peaks a training benchmark compares against, measured once per process.
struct MachinePeaks {
  double fp32_sgemm = 0.0;         ///< GFLOP/s, 2048^3 (OpenBLAS)
  double bf16_gemm = 0.0;          ///< GFLOP/s, 2048^3
  double bf16_conv_channels_last = 0.0;  ///< GFLOP/s, 3x3 64->64 56x56 batch 32, forward
  double fp32_conv_channels_last = 0.0;  ///< the same in fp32, for reference

  /// @brief The peak of the precision a model runs in: bf16's gemm or fp32's sgemm.
  double for_precision(bool bf16) const { return bf16 ? bf16_gemm : fp32_sgemm; }

  static MachinePeaks measure() {
    MachinePeaks p;
    p.fp32_sgemm = cpu_sgemm_gflops();
    p.bf16_gemm = cpu_bf16_gemm_gflops();
    p.bf16_conv_channels_last = cpu_conv3x3_gflops(torch::kBFloat16, true);
    p.fp32_conv_channels_last = cpu_conv3x3_gflops(torch::kFloat32, true);
    return p;
  }
};

/// @brief "Intel(R) Xeon(R) Platinum 8480C": /proc/cpuinfo's model name.
inline std::string cpu_model_name() {
  const std::string name = trainloop::detail::cpuinfo_value(trainloop::detail::cpuinfo_text(), "model name");
  return name.empty() ? "unknown CPU" : name;
}

/// @brief The CPU's vector flags that decide the fast paths: "avx512f avx512_bf16 amx_bf16".
inline std::string cpu_fast_path_flags() {
  std::string found;
  for (const char* flag : {"avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}) {
    if (trainloop::detail::cpuinfo_has_flag(trainloop::detail::cpuinfo_text(), flag)) found += std::string(flag) + ' ';
  }
  if (!found.empty()) found.pop_back();
  return found;
}

}  // namespace bench
