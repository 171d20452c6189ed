#pragma once
/// @file
/// @brief The numeric precision of training: fp32, or mixed precision with bf16 or fp16 autocast.
///
/// | precision | forward and loss                | gradients, weights, optimizer | loss scaling            |
/// |-----------|---------------------------------|-------------------------------|-------------------------|
/// | fp32      | float32                         | float32                       | none                    |
/// | bf16      | autocast to bfloat16 (CPU, CUDA) | float32                       | none (bf16 has fp32's range) |
/// | fp16      | autocast to float16 (CUDA)      | float32                       | dynamic (GradScaler)    |
///
/// Like Lightning's `precision="bf16-mixed"` and fastai's `to_fp16()`; set with
/// TrainLoopOptions::precision or `--precision` in the examples.

#include <trainloop/error.hpp>

#include <string>

namespace trainloop {

/// @brief Numeric precision of the forward pass (see the table in precision.hpp).
enum class Precision {
  fp32,  ///< everything in float32 (the default)
  bf16,  ///< bfloat16 autocast, float32 weights
  fp16   ///< float16 autocast with dynamic loss scaling (CUDA)
};

/// @brief The name of `precision`: "fp32", "bf16" or "fp16".
inline std::string to_string(Precision precision) {
  switch (precision) {
    case Precision::bf16: return "bf16";
    case Precision::fp16: return "fp16";
    default: return "fp32";
  }
}

/// @brief Parses "fp32", "bf16" (or "bf16-mixed") and "fp16" (or "16-mixed").
/// @throws trainloop::ConfigurationError naming the text and the accepted names.
inline Precision parse_precision(const std::string& text) {
  if (text == "fp32" || text == "32") return Precision::fp32;
  if (text == "bf16" || text == "bf16-mixed") return Precision::bf16;
  if (text == "fp16" || text == "16-mixed") return Precision::fp16;
  throw ConfigurationError("trainloop: precision is '" + text + "'; expected fp32, bf16 or fp16");
}

}  // namespace trainloop
