#pragma once
/// @file
/// @brief fastai's fit_flat_cos: the learning rate stays flat for pct_start of the steps, then
/// anneals by a cosine to lr / div_final. Momentum is left as it is.

#include <trainloop/error.hpp>
#include <trainloop/schedules/step_schedule.hpp>

#include <torch/arg.h>

namespace trainloop {

/// @brief Options of FlatCos; defaults are fastai's.
struct FlatCosOptions {
  /// @param lr the flat learning rate; 0 or less: the optimizer's
  explicit FlatCosOptions(double lr = 0.0) : lr_(lr) {}
  /// The flat learning rate (0 or less: the optimizer's).
  TORCH_ARG(double, lr);
  /// Fraction of the steps at the flat learning rate.
  TORCH_ARG(double, pct_start) = 0.75;
  /// The last learning rate is lr / div_final.
  TORCH_ARG(double, div_final) = 1e5;
};

/// @brief Flat, then cosine annealing, per optimizer step.
class FlatCos : public StepSchedule {
 public:
  /// @brief fastai's spelling, `FlatCos(1e-3)`: other options at their defaults.
  /// @param lr the flat learning rate
  explicit FlatCos(double lr) : FlatCos(FlatCosOptions(lr)) {}
  /// @brief The schedule with `options`.
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit FlatCos(FlatCosOptions options = FlatCosOptions()) : options_(options) {
    TRAINLOOP_CHECK(options_.pct_start() >= 0.0 && options_.pct_start() < 1.0, "flat-cos pct_start is ",
                    options_.pct_start(), "; expected a fraction in [0, 1)");
    TRAINLOOP_CHECK(options_.div_final() > 0.0, "flat-cos div_final is ", options_.div_final(), "; expected a positive number");
  }

  ScheduledValues values_at(int64_t step, int64_t total_steps, const ScheduledValues& base) const override {
    const double lr = options_.lr() > 0.0 ? options_.lr() : base.learning_rate;
    const double at = static_cast<double>(step) / static_cast<double>(total_steps);
    if (at < options_.pct_start()) return {lr, std::nullopt};
    return {anneal_cos(lr, lr / options_.div_final(), (at - options_.pct_start()) / (1.0 - options_.pct_start())),
            std::nullopt};
  }

 private:
  FlatCosOptions options_;
};

}  // namespace trainloop
