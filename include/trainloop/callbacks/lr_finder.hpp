#pragma once
/// @file
/// @brief The learning-rate finder (fastai's lr_find, Smith's range test): the learning rate
/// grows exponentially from start_lr to end_lr over num_steps optimizer steps while the smoothed
/// loss is recorded; the sweep stops when the loss diverges. TrainLoop::lr_find() runs it and
/// puts the model, optimizer, progress and random streams back where they were.
///
/// @code
/// auto found = loop.lr_find();                  // every mode; under DDP every rank gets the same
/// std::cout << "suggested lr " << found.valley << '\n';
/// @endcode
///
/// Under DDP the loss of each step is averaged over the ranks before smoothing, so every rank
/// records the same curve and agrees on the divergence stop.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/hyperparameters.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace trainloop {

/// @brief Options of the learning-rate finder; defaults are fastai's.
struct LrFinderOptions {
  /// The first learning rate.
  TORCH_ARG(double, start_lr) = 1e-7;
  /// The last learning rate.
  TORCH_ARG(double, end_lr) = 10.0;
  /// Optimizer steps of the sweep.
  TORCH_ARG(int64_t, num_steps) = 100;
  /// Stop when the smoothed loss exceeds divergence_factor × its minimum (or is not finite).
  TORCH_ARG(bool, stop_on_divergence) = true;
  /// See stop_on_divergence.
  TORCH_ARG(double, divergence_factor) = 4.0;
  /// Exponential smoothing of the loss (bias-corrected, as fastai's).
  TORCH_ARG(double, smoothing) = 0.98;
};

/// @brief What the sweep measured, and the suggested learning rates.
struct LrFinderResult {
  std::vector<double> learning_rates;  ///< the learning rate of each step
  std::vector<double> losses;          ///< the smoothed loss after each step
  double valley = 0.0;                 ///< fastai's default suggestion: inside the longest descent of the curve
  double steepest = 0.0;               ///< where the loss falls fastest against log(lr)
  double minimum_tenth = 0.0;          ///< a tenth of the learning rate with the lowest loss
  bool diverged = false;               ///< the sweep stopped early because the loss diverged
};

/// @brief Suggestions from a recorded sweep, as fastai computes them: the first tenth of the steps
/// and the last five are left out (warm-up noise, divergence), then valley, steepest and minimum/10.
inline LrFinderResult suggest_learning_rates(std::vector<double> lrs, std::vector<double> losses, int64_t num_steps) {
  LrFinderResult result;
  result.learning_rates = lrs;
  result.losses = losses;
  TRAINLOOP_CHECK(lrs.size() == losses.size() && lrs.size() >= 2, "the learning-rate sweep recorded ", lrs.size(),
                  " steps; expected at least 2 (raise num_steps, or lower start_lr)");
  const size_t skip_start = static_cast<size_t>(num_steps / 10);
  if (lrs.size() > skip_start + 5 + 2) {
    lrs = std::vector<double>(lrs.begin() + static_cast<std::ptrdiff_t>(skip_start), lrs.end() - 5);
    losses = std::vector<double>(losses.begin() + static_cast<std::ptrdiff_t>(skip_start), losses.end() - 5);
  }
  const size_t n = losses.size();
  // Valley: the longest decreasing subsequence of the losses; the suggestion is taken half-way
  // through its middle third (fastai: start + sections + sections / 2, sections = length / 3).
  std::vector<size_t> run(n, 1);
  size_t max_start = 0, max_end = 0;
  for (size_t i = 1; i < n; ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (losses[i] < losses[j] && run[i] < run[j] + 1) run[i] = run[j] + 1;
      if (run[max_end] < run[i]) {  // inside the j loop, as fastai's (its start can lag the run's)
        max_end = i;
        max_start = max_end - run[max_end];
      }
    }
  }
  const double sections = static_cast<double>(max_end - max_start) / 3.0;
  const size_t valley = std::min(n - 1, max_start + static_cast<size_t>(sections) + static_cast<size_t>(sections / 2.0));
  result.valley = lrs[valley];
  // Steepest: the most negative d(loss) / d(log lr).
  size_t steepest = 0;
  double best_slope = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i + 1 < n; ++i) {
    const double slope = (losses[i + 1] - losses[i]) / (std::log(lrs[i + 1]) - std::log(lrs[i]));
    if (slope < best_slope) {
      best_slope = slope;
      steepest = i;
    }
  }
  result.steepest = lrs[steepest];
  const auto lowest = std::min_element(losses.begin(), losses.end()) - losses.begin();
  result.minimum_tenth = lrs[static_cast<size_t>(lowest)] / 10.0;
  return result;
}

/// @brief The sweep as a callback (TrainLoop::lr_find() runs it; see the file comment).
class LrFinder : public Callback {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit LrFinder(LrFinderOptions options = LrFinderOptions()) : options_(options) {
    TRAINLOOP_CHECK(options_.start_lr() > 0.0 && options_.end_lr() > options_.start_lr(), "lr_find sweeps from ",
                    options_.start_lr(), " to ", options_.end_lr(), "; expected 0 < start_lr < end_lr");
    TRAINLOOP_CHECK(options_.num_steps() >= 2, "lr_find num_steps is ", options_.num_steps(), "; expected 2 or more");
    TRAINLOOP_CHECK(options_.smoothing() >= 0.0 && options_.smoothing() < 1.0, "lr_find smoothing is ",
                    options_.smoothing(), "; expected a factor in [0, 1)");
  }

  void on_fit_begin(TrainState& state) override {
    lrs_.clear();
    losses_.clear();
    average_ = 0.0;
    best_ = std::numeric_limits<double>::infinity();
    diverged_ = false;
    set_learning_rate(*state.optimizer, lr_at(0));
  }
  void on_before_optimizer_step(TrainState& state) override { set_learning_rate(*state.optimizer, lr_at(state.step)); }
  void on_step_end(TrainState& state) override {
    const double loss = state.mean_over_ranks(state.last_loss());  // the same curve on every rank
    average_ = options_.smoothing() * average_ + (1.0 - options_.smoothing()) * loss;
    const double smoothed = average_ / (1.0 - std::pow(options_.smoothing(), static_cast<double>(losses_.size() + 1)));
    lrs_.push_back(learning_rate_of(*state.optimizer));
    losses_.push_back(smoothed);
    best_ = std::min(best_, smoothed);
    if (options_.stop_on_divergence() && (!std::isfinite(smoothed) || smoothed > options_.divergence_factor() * best_)) {
      diverged_ = true;
      state.request_stop(detail::concat("lr_find: the loss diverged at lr ", lrs_.back()));
    }
  }

  /// @brief The sweep's record and suggestions. @throws trainloop::ConfigurationError if fewer than 2 steps ran.
  LrFinderResult result() const {
    std::vector<double> lrs = lrs_, losses = losses_;
    if (diverged_ && lrs.size() > 2) {  // the diverging point itself is no candidate
      lrs.pop_back();
      losses.pop_back();
    }
    auto found = suggest_learning_rates(lrs, losses, options_.num_steps());
    found.learning_rates = lrs_;
    found.losses = losses_;
    found.diverged = diverged_;
    return found;
  }

  // The record travels back from spawned DDP ranks to the caller's object.
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("lrs", torch::tensor(lrs_, torch::kFloat64));
    archive.write("losses", torch::tensor(losses_, torch::kFloat64));
    archive.write("diverged", torch::tensor(diverged_ ? 1 : 0, torch::kInt64));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor lrs, losses, diverged;
    if (!archive.try_read("lrs", lrs) || !archive.try_read("losses", losses)) return;
    lrs_ = std::vector<double>(lrs.data_ptr<double>(), lrs.data_ptr<double>() + lrs.numel());
    losses_ = std::vector<double>(losses.data_ptr<double>(), losses.data_ptr<double>() + losses.numel());
    diverged_ = archive.try_read("diverged", diverged) && diverged.item<int64_t>() != 0;
  }

 private:
  double lr_at(int64_t step) const {
    const double position = static_cast<double>(step) / static_cast<double>(options_.num_steps() - 1);
    return options_.start_lr() * std::pow(options_.end_lr() / options_.start_lr(), position);
  }

  LrFinderOptions options_;
  std::vector<double> lrs_, losses_;
  double average_ = 0.0;
  double best_ = std::numeric_limits<double>::infinity();
  bool diverged_ = false;
};

}  // namespace trainloop
