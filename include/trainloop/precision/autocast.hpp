#pragma once
/// @file
/// @brief Autocast for one forward pass, in the calling thread (autocast is thread-local, so each
/// DataParallel replica's thread switches it itself).

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/precision/precision.hpp>

#include <torch/torch.h>

namespace trainloop {

/// @brief Turns autocast on for `device` in this thread for its lifetime (no-op for fp32), and
/// restores the previous setting after, clearing autocast's cast cache when the outermost one ends.
class AutocastGuard {
 public:
  /// @brief Autocast to `precision`'s type on `device`'s type, in this thread.
  AutocastGuard(Precision precision, const torch::Device& device) : device_(device.type()) {
    if (precision == Precision::fp32) return;
    active_ = true;
    previous_ = detail::autocast_setting(device_);
    detail::set_autocast_setting(device_, {true, precision == Precision::bf16 ? at::kBFloat16 : at::kHalf});
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!active_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    detail::set_autocast_setting(device_, previous_);
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool active_ = false;
  detail::AutocastSetting previous_;
};

}  // namespace trainloop
