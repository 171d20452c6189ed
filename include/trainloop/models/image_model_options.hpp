#pragma once
/// @file
/// @brief ImageModelOptions: what every architecture of the model zoo takes (classes, input
/// channels, kind of batch norm).

#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>

namespace trainloop::models {

/// @brief Options shared by every architecture of the zoo, in libtorch's fluent style:
/// `ImageModelOptions().num_classes(10).in_channels(1).sync_batchnorm(true)`.
struct ImageModelOptions {
  /// Outputs of the final Linear layer (one logit per class).
  TORCH_ARG(int64_t, num_classes) = 1000;
  /// Channels of the input images (3 for RGB, 1 for greyscale): the first convolution's input.
  TORCH_ARG(int64_t, in_channels) = 3;
  /// Every batch norm is a trainloop::nn::SyncBatchNorm (statistics of the global batch under DDP
  /// with TrainLoopOptions::sync_batchnorm) instead of torch::nn::BatchNorm2d. The names and
  /// shapes of parameters and buffers are the same either way, so checkpoints load into both.
  TORCH_ARG(bool, sync_batchnorm) = false;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::ConfigurationError naming the first option that is out of range.
  void validate() const {
    TRAINLOOP_CHECK(num_classes_ > 0, "num_classes is ", num_classes_, "; expected a positive number");
    TRAINLOOP_CHECK(in_channels_ > 0, "in_channels is ", in_channels_, "; expected a positive number");
  }
};

}  // namespace trainloop::models
