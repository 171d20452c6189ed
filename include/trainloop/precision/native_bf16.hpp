#pragma once
/// @file
/// @brief Whether bf16 runs on bf16 hardware on this CPU, and the one warning when it does not.
///
/// With AVX512-BF16 or AMX-BF16, oneDNN 2.6 (libtorch 1.13) runs bf16 convolutions and matmuls in
/// native kernels. Measured with ONEDNN_VERBOSE=1 on an Intel Xeon with AMX (the example, bf16,
/// channels-last): forward convolutions `brgconv:avx512_core_amx_bf16`, backward
/// `jit:avx512_core_amx_bf16`, matmuls `brg:avx512_core_amx_bf16` (a 1-channel first
/// convolution `jit_bf16:avx512_core_bf16`). Without those instructions (here emulated with
/// ONEDNN_MAX_CPU_ISA=AVX512_CORE) the same run uses `jit_bf16:avx512_core` convolutions, which
/// convert bf16 to fp32 and back in software, and `gemm:jit` matmuls: bf16 then buys nothing over
/// fp32 and adds the casts, so the loop says so once.

#include <trainloop/detail/cpuinfo.hpp>
#include <trainloop/detail/environment.hpp>
#include <trainloop/precision/precision.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <iostream>
#include <string>

namespace trainloop {
namespace detail {

/// Whether `cpuinfo` (the text of /proc/cpuinfo) lists avx512_bf16 or amx_bf16 among the flags.
inline bool cpuinfo_has_bf16(const std::string& cpuinfo) {
  return cpuinfo_has_flag(cpuinfo, "avx512_bf16") || cpuinfo_has_flag(cpuinfo, "amx_bf16");
}

/// Whether a ONEDNN_MAX_CPU_ISA / DNNL_MAX_CPU_ISA value still allows oneDNN's bf16 instructions.
inline bool isa_cap_allows_bf16(std::string cap) {
  std::transform(cap.begin(), cap.end(), cap.begin(), [](unsigned char c) { return static_cast<char>(std::toupper(c)); });
  return cap == "ALL" || cap == "AVX512_CORE_BF16" || cap == "AVX512_CORE_FP16" || cap.rfind("AVX512_CORE_AMX", 0) == 0;
}

}  // namespace detail

/// @brief Whether this CPU runs bf16 in hardware for oneDNN: it has AVX512-BF16 or AMX-BF16
/// (/proc/cpuinfo) and ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA) does not cap oneDNN below them.
inline bool cpu_has_native_bf16() {
  for (const char* cap_variable : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    if (auto cap = detail::env_string(cap_variable); cap && !detail::isa_cap_allows_bf16(*cap)) return false;
  }
  return detail::cpuinfo_has_bf16(detail::cpuinfo_text());
}

/// @brief Warns once per process, on standard error, when `precision` is bf16 on a CPU device
/// without bf16 hardware (see the file comment). Returns whether it warned now.
inline bool warn_if_bf16_is_emulated(Precision precision, const torch::Device& device) {
  static std::atomic<bool> warned{false};
  if (precision != Precision::bf16 || !device.is_cpu() || cpu_has_native_bf16() || warned.exchange(true)) return false;
  std::cerr << "trainloop: warning: precision bf16 on a CPU without AVX512-BF16 or AMX-BF16 (or with oneDNN capped "
               "below them by ONEDNN_MAX_CPU_ISA): oneDNN emulates bf16 in fp32 kernels with conversions around each, "
               "so bf16 will not be faster than fp32 here and may be slower; fp32 is the better choice on this CPU\n";
  return true;
}

}  // namespace trainloop
