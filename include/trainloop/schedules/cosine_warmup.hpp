#pragma once
/// @file
/// @brief Cosine decay with a linear warm-up (as Hugging Face's get_cosine_schedule_with_warmup,
/// except that the last step reaches min_lr): the learning rate rises linearly from 0 over the
/// warm-up steps, then decays by a half cosine
/// to min_lr at the last step.

#include <trainloop/error.hpp>
#include <trainloop/schedules/step_schedule.hpp>

#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace trainloop {

/// @brief Options of CosineWarmup.
struct CosineWarmupOptions {
  /// @param lr the peak learning rate; 0 or less: the optimizer's
  explicit CosineWarmupOptions(double lr = 0.0) : lr_(lr) {}
  /// The peak learning rate (0 or less: the optimizer's).
  TORCH_ARG(double, lr);
  /// Warm-up as a fraction of the fit's steps (used when warmup_steps is 0).
  TORCH_ARG(double, warmup_pct) = 0.05;
  /// Warm-up steps; 0: warmup_pct of the steps.
  TORCH_ARG(int64_t, warmup_steps) = 0;
  /// The learning rate at the last step.
  TORCH_ARG(double, min_lr) = 0.0;
};

/// @brief Linear warm-up, then cosine decay, per optimizer step.
class CosineWarmup : public StepSchedule {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit CosineWarmup(CosineWarmupOptions options = CosineWarmupOptions()) : options_(options) {
    TRAINLOOP_CHECK(options_.warmup_pct() >= 0.0 && options_.warmup_pct() < 1.0, "cosine warm-up warmup_pct is ",
                    options_.warmup_pct(), "; expected a fraction in [0, 1)");
    TRAINLOOP_CHECK(options_.warmup_steps() >= 0, "cosine warm-up warmup_steps is ", options_.warmup_steps(),
                    "; expected 0 or more");
  }

  ScheduledValues values_at(int64_t step, int64_t total_steps, const ScheduledValues& base) const override {
    const double lr = options_.lr() > 0.0 ? options_.lr() : base.learning_rate;
    const int64_t warmup = options_.warmup_steps() > 0
                               ? std::min(options_.warmup_steps(), total_steps - 1)
                               : static_cast<int64_t>(options_.warmup_pct() * static_cast<double>(total_steps));
    if (step < warmup) return {lr * static_cast<double>(step) / static_cast<double>(warmup), std::nullopt};
    const double progress =
        static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total_steps - 1 - warmup));
    const double min_lr = options_.min_lr();
    return {min_lr + (lr - min_lr) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress)), std::nullopt};
  }

 private:
  CosineWarmupOptions options_;
};

}  // namespace trainloop
