#pragma once
/// @file
/// @brief Dynamic loss scaling for fp16 training, with torch.amp.GradScaler's semantics: the loss
/// is multiplied by the scale before backward (so small fp16 gradients do not flush to zero);
/// before the optimizer step the gradients are unscaled and checked; a step whose gradients hold
/// an inf or NaN is skipped and the scale halved; after growth_interval good steps in a row the
/// scale doubles. libtorch has no C++ GradScaler: this one is built on the ATen op PyTorch's uses
/// (`_amp_foreach_non_finite_check_and_unscale_`, detail/torch_compat.hpp).
///
/// The training loop owns one when TrainLoopOptions::precision is fp16: it unscales after the
/// gradients are reduced across ranks and before clipping, makes every rank agree on the skip,
/// and keeps the scaler's state in checkpoints.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief Options of GradScaler; defaults are PyTorch's.
struct GradScalerOptions {
  /// The first scale.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// The scale is multiplied by this after growth_interval steps without inf/NaN gradients.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// The scale is multiplied by this after a step with inf/NaN gradients.
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Good steps in a row before the scale grows.
  TORCH_ARG(int64_t, growth_interval) = 2000;
};

/// @brief Loss scale, unscaling with the inf/NaN check, and the scale's update (see the file comment).
class GradScaler {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit GradScaler(GradScalerOptions options = GradScalerOptions()) : options_(options), scale_(options.init_scale()) {
    TRAINLOOP_CHECK(options_.init_scale() > 0.0, "loss scale init_scale is ", options_.init_scale(), "; expected a positive number");
    TRAINLOOP_CHECK(options_.growth_factor() > 1.0, "loss scale growth_factor is ", options_.growth_factor(),
                    "; expected a factor above 1");
    TRAINLOOP_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0, "loss scale backoff_factor is ",
                    options_.backoff_factor(), "; expected a factor in (0, 1)");
    TRAINLOOP_CHECK(options_.growth_interval() >= 1, "loss scale growth_interval is ", options_.growth_interval(),
                    "; expected 1 or more");
  }

  /// @brief The factor the loss is multiplied by before backward.
  double scale() const { return scale_; }
  /// @brief Good steps since the scale last changed.
  int64_t growth_tracker() const { return growth_tracker_; }
  /// @brief Steps skipped for inf/NaN gradients so far.
  int64_t skipped_steps() const { return skipped_; }

  /// @brief Divides the gradients of `parameters` by the scale, in place; true when any of them
  /// holds an inf or NaN (on this process: the caller agrees over ranks before skipping).
  bool unscale(const std::vector<torch::Tensor>& parameters) {
    std::vector<std::pair<torch::Device, std::vector<torch::Tensor>>> grads_by_device;  // the ATen op takes one device
    for (const auto& p : parameters) {
      if (!p.grad().defined()) continue;
      auto it = std::find_if(grads_by_device.begin(), grads_by_device.end(),
                             [&](const auto& entry) { return entry.first == p.grad().device(); });
      if (it == grads_by_device.end()) it = grads_by_device.insert(grads_by_device.end(), {p.grad().device(), {}});
      it->second.push_back(p.grad());
    }
    bool found = false;
    for (auto& [device, grads] : grads_by_device) {
      auto options = torch::TensorOptions().dtype(torch::kFloat32).device(device);
      auto found_inf = torch::zeros({1}, options);
      // As PyTorch: the reciprocal in double, then float.
      auto inv_scale = torch::full({1}, 1.0 / scale_, torch::TensorOptions().dtype(torch::kFloat64)).to(options);
      detail::amp_unscale_and_check(grads, found_inf, inv_scale);
      found = found || found_inf.item<float>() != 0.0f;
    }
    return found;
  }

  /// @brief After a step: backs off (and counts a skipped step) when `found_inf`, else counts a
  /// good step and grows the scale after growth_interval of them.
  void update(bool found_inf) {
    if (found_inf) {
      scale_ *= options_.backoff_factor();
      growth_tracker_ = 0;
      ++skipped_;
      return;
    }
    if (++growth_tracker_ == options_.growth_interval()) {
      const double grown = scale_ * options_.growth_factor();
      if (std::isfinite(static_cast<float>(grown))) scale_ = grown;  // as PyTorch: never an infinite scale
      growth_tracker_ = 0;
    }
  }

  /// @brief The state to keep in a checkpoint: (scale, growth tracker, skipped steps).
  torch::Tensor state() const {
    return torch::tensor({scale_, static_cast<double>(growth_tracker_), static_cast<double>(skipped_)}, torch::kFloat64);
  }
  /// @brief Restores what state() returned.
  void load_state(const torch::Tensor& state) {
    TRAINLOOP_CHECK(state.numel() == 3, "a loss-scaler state of ", state.numel(), " values; expected 3");
    scale_ = state[0].item<double>();
    growth_tracker_ = static_cast<int64_t>(state[1].item<double>());
    skipped_ = static_cast<int64_t>(state[2].item<double>());
  }

 private:
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  int64_t skipped_ = 0;
};

}  // namespace trainloop
