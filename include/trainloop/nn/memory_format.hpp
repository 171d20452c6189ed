#pragma once
/// @file
/// @brief The memory format a model trains in: contiguous (NCHW) or channels-last (NHWC), and
/// the rule that picks it by itself.
///
/// Channels-last puts the channels of one pixel next to each other, the layout oneDNN's CPU
/// convolutions (and cuDNN's tensor-core ones) run fastest in; libtorch's default is NCHW, which
/// they first reorder. Measured with Debian's python3-torch 1.13 (the same libtorch and oneDNN),
/// 2 threads, Adam, batch 64, samples/s, Intel Xeon with AMX (issue 19's table):
///
/// | model                         | fp32 NCHW | fp32 NHWC | bf16 NCHW | bf16 NHWC |
/// |-------------------------------|-----------|-----------|-----------|-----------|
/// | the example's CNN (28x28)     | 3,796     | 5,356     | 5,154     | 9,698     |
/// | resnet18, 64x64, 10 classes   | 209       | 215       | 264       | 295       |
///
/// So MemoryFormat::automatic (the default) chooses channels-last for any model with a 2-d
/// convolution (a 4-d parameter), in every precision; models without one (MLPs, 1-d and 3-d
/// convolutions, transformers) stay contiguous, where channels-last means nothing.
///
/// What changes: the model's 4-d parameters and buffers (converted in place, so the optimizer's
/// references stay valid), and the 4-d inputs of torch::data::Example batches before forward().
/// A model with its own batch type (batch_loss) gets its inputs as the dataset made them and may
/// convert them itself. Results equal contiguous training up to floating-point summation order
/// (tests/test_memory_format.cpp); checkpoints hold the model's tensors contiguous, so any
/// program loads them with torch::load, and a checkpoint resumes in either format.

#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <ostream>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief The memory format of a model's 4-d tensors and inputs (see nn/memory_format.hpp).
enum class MemoryFormat {
  automatic,     ///< channels-last for models with a 2-d convolution, contiguous otherwise (the default)
  contiguous,    ///< NCHW, libtorch's default
  channels_last  ///< NHWC for every 4-d parameter, buffer and input
};

/// @brief The name of `format`: "auto", "contiguous" or "channels-last".
inline std::string to_string(MemoryFormat format) {
  switch (format) {
    case MemoryFormat::contiguous: return "contiguous";
    case MemoryFormat::channels_last: return "channels-last";
    default: return "auto";
  }
}

/// @brief Writes to_string(format).
inline std::ostream& operator<<(std::ostream& out, MemoryFormat format) { return out << to_string(format); }

/// @brief Parses "auto", "contiguous" and "channels-last" (or "channels_last", as PyTorch spells it).
/// @throws trainloop::ConfigurationError naming the text and the accepted names.
inline MemoryFormat parse_memory_format(const std::string& text) {
  if (text == "auto") return MemoryFormat::automatic;
  if (text == "contiguous") return MemoryFormat::contiguous;
  if (text == "channels-last" || text == "channels_last") return MemoryFormat::channels_last;
  throw ConfigurationError("trainloop: memory format is '" + text + "'; expected auto, contiguous or channels-last");
}

namespace nn {

/// @brief Whether `module` has a 2-d convolution, judged by its parameters: any 4-d one.
inline bool has_2d_convolution(const torch::nn::Module& module) {
  for (const auto& parameter : module.parameters()) {
    if (parameter.dim() == 4) return true;
  }
  return false;
}

/// @brief Whether `format` means channels-last for `module` (the automatic rule: it has a 2-d convolution).
inline bool uses_channels_last(MemoryFormat format, const torch::nn::Module& module) {
  if (format == MemoryFormat::automatic) return has_2d_convolution(module);
  return format == MemoryFormat::channels_last;
}

/// @brief Puts every 4-d parameter and buffer of `module` in channels-last (or back in
/// contiguous) memory, in place: the tensors stay the same objects, so an optimizer built over
/// them keeps working. Already in that format: nothing is copied.
inline void to_memory_format(torch::nn::Module& module, bool channels_last) {
  const auto format = channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous;
  torch::NoGradGuard no_grad;
  auto convert = [format](torch::Tensor& tensor) {
    // Judged by the layout libtorch's kernels will read (suggest_memory_format), not by
    // is_contiguous(format): a weight with one input channel, like a first convolution on grey
    // images (32 x 1 x 3 x 3), is "contiguous" in both formats, so contiguous(format) leaves its
    // NCHW strides, oneDNN then runs that convolution and the max-pool after it in NCHW, and the
    // next layer copies back: the example's CNN trained at 0.94x of fp32 contiguous with
    // channels-last that way, 1.29x once restrided (benchmarks/README.md, cpu_fast_paths).
    // Python's module.to(memory_format=...) restrides the same way.
    if (tensor.defined() && tensor.dim() == 4 && tensor.suggest_memory_format() != format) {
      tensor.set_data(tensor.data().to(tensor.options(), /*non_blocking=*/false, /*copy=*/false, format));
    }
  };
  for (auto& parameter : module.parameters()) convert(parameter);
  for (auto& buffer : module.buffers()) convert(buffer);
}

/// @brief `input` in channels-last memory when it is 4-d and `channels_last`; otherwise itself.
inline torch::Tensor input_in_memory_format(const torch::Tensor& input, bool channels_last) {
  if (!channels_last || !input.defined() || input.dim() != 4) return input;
  return input.contiguous(torch::MemoryFormat::ChannelsLast);
}

/// @brief While it lives, the 4-d tensors of a channels-last module are contiguous (for writing
/// a file any program reads in libtorch's default layout); then their own memory again: each
/// tensor gets back the very storage it had, so what aliases it (DDP's sharded pieces and units,
/// gradient buckets) still does.
class ContiguousScope {
 public:
  /// @param module the model, converted to contiguous now and given back its own tensors at the end of the scope
  /// @param channels_last whether the model trains in channels-last (false: the scope does nothing)
  ContiguousScope(torch::nn::Module& module, bool channels_last) {
    if (!channels_last) return;
    torch::NoGradGuard no_grad;
    auto convert = [this](torch::Tensor tensor) {
      if (!tensor.defined() || tensor.dim() != 4 || tensor.suggest_memory_format() == torch::MemoryFormat::Contiguous) return;
      torch::Tensor own = tensor.data();  // shares the storage: set_data gives it back as it was
      tensor.set_data(own.contiguous());
      converted_.emplace_back(std::move(tensor), std::move(own));
    };
    for (auto& parameter : module.parameters()) convert(parameter);
    for (auto& buffer : module.buffers()) convert(buffer);
  }
  ContiguousScope(const ContiguousScope&) = delete;
  ContiguousScope& operator=(const ContiguousScope&) = delete;
  ~ContiguousScope() {
    torch::NoGradGuard no_grad;
    for (auto& [tensor, own] : converted_) tensor.set_data(own);  // no copy: nothing can fail
  }

 private:
  std::vector<std::pair<torch::Tensor, torch::Tensor>> converted_;  // each tensor and its own memory
};

}  // namespace nn
}  // namespace trainloop
