#pragma once
/// @file
/// @brief The one-cycle schedule (Smith; fastai's fit_one_cycle, PyTorch's OneCycleLR): the
/// learning rate warms up from max_lr/div to max_lr by cosine annealing over pct_start of the
/// steps, then anneals to max_lr/div_final; momentum moves the other way (0.95 → 0.85 → 0.95).
///
/// @code
/// loop.fit(4, {std::make_shared<trainloop::OneCycle>(trainloop::OneCycleOptions(3e-3))});
/// @endcode
///
/// Positions follow fastai by default (step k of N sits at k/N; the peak is reached at step
/// pct_start·N). `OneCycleOptions::pytorch(max_lr)` gives PyTorch OneCycleLR's defaults and its
/// positions (phase ends at steps pct_start·N − 1 and N − 1), value for value.

#include <trainloop/error.hpp>
#include <trainloop/schedules/step_schedule.hpp>

#include <torch/arg.h>

#include <cstdint>

namespace trainloop {

/// @brief Options of OneCycle; defaults are fastai's.
struct OneCycleOptions {
  /// Where a step sits in the cycle.
  enum class Positions {
    Fastai,  ///< step k of N at k / N
    PyTorch  ///< OneCycleLR's: the warm-up ends at step pct_start·N − 1, the cycle at N − 1
  };
  /// @param max_lr the peak learning rate; 0 or less: the optimizer's learning rate
  explicit OneCycleOptions(double max_lr = 0.0) : max_lr_(max_lr) {}
  /// PyTorch OneCycleLR's defaults: pct_start 0.3, final lr = max_lr / 25 / 1e4.
  static OneCycleOptions pytorch(double max_lr) {
    return OneCycleOptions(max_lr).pct_start(0.3).div_final(25.0 * 1e4).positions(Positions::PyTorch);
  }
  /// The peak learning rate (0 or less: the optimizer's).
  TORCH_ARG(double, max_lr);
  /// The first learning rate is max_lr / div.
  TORCH_ARG(double, div) = 25.0;
  /// The last learning rate is max_lr / div_final.
  TORCH_ARG(double, div_final) = 1e5;
  /// Fraction of the steps spent warming up.
  TORCH_ARG(double, pct_start) = 0.25;
  /// Cycle the momentum (SGD momentum, Adam's beta1) inversely to the learning rate.
  TORCH_ARG(bool, cycle_momentum) = true;
  /// Momentum at the start and the end of the cycle.
  TORCH_ARG(double, momentum_max) = 0.95;
  /// Momentum at the peak learning rate.
  TORCH_ARG(double, momentum_min) = 0.85;
  /// Where a step sits in the cycle.
  TORCH_ARG(Positions, positions) = Positions::Fastai;
};

/// @brief One-cycle learning rate and momentum, per optimizer step (see the file comment).
class OneCycle : public StepSchedule {
 public:
  /// @brief fastai's spelling, `OneCycle(1e-3)`: other options at their defaults.
  /// @param lr the peak learning rate
  explicit OneCycle(double lr) : OneCycle(OneCycleOptions(lr)) {}
  /// @brief The schedule with `options`.
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit OneCycle(OneCycleOptions options = OneCycleOptions()) : options_(options) {
    TRAINLOOP_CHECK(options_.pct_start() > 0.0 && options_.pct_start() < 1.0, "one-cycle pct_start is ",
                    options_.pct_start(), "; expected a fraction in (0, 1)");
    TRAINLOOP_CHECK(options_.div() > 0.0, "one-cycle div is ", options_.div(), "; expected a positive number");
    TRAINLOOP_CHECK(options_.div_final() > 0.0, "one-cycle div_final is ", options_.div_final(),
                    "; expected a positive number");
  }

  ScheduledValues values_at(int64_t step, int64_t total_steps, const ScheduledValues& base) const override {
    const double peak = options_.max_lr() > 0.0 ? options_.max_lr() : base.learning_rate;
    const double first = peak / options_.div(), last = peak / options_.div_final();
    const double high = options_.momentum_max(), low = options_.momentum_min();
    ScheduledValues values;
    double position = 0.0;
    bool warming = false;
    if (options_.positions() == OneCycleOptions::Positions::Fastai) {
      const double at = static_cast<double>(step) / static_cast<double>(total_steps);
      warming = at < options_.pct_start();
      position = warming ? at / options_.pct_start() : (at - options_.pct_start()) / (1.0 - options_.pct_start());
    } else {
      const double warm_end = options_.pct_start() * static_cast<double>(total_steps) - 1.0;
      const double end = static_cast<double>(total_steps) - 1.0;
      const double k = static_cast<double>(step);
      warming = k <= warm_end;
      // A warm-up shorter than one step (pct_start·N <= 1) starts at the peak, not at 0/0.
      position = warming ? (warm_end > 0.0 ? k / warm_end : 1.0) : (k - warm_end) / (end - warm_end);
    }
    values.learning_rate = warming ? anneal_cos(first, peak, position) : anneal_cos(peak, last, position);
    if (options_.cycle_momentum() && base.momentum) {
      values.momentum = warming ? anneal_cos(high, low, position) : anneal_cos(low, high, position);
    }
    return values;
  }

  /// @brief The options.
  const OneCycleOptions& options() const { return options_; }

 private:
  OneCycleOptions options_;
};

}  // namespace trainloop
