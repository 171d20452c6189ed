#pragma once
/// @file
/// @brief The base of every per-step schedule: before each optimizer step it sets the learning
/// rate (and momentum) of that step from the step's position in the fit() call, as counted by
/// the loop.
///
/// The loop knows the true number of optimizer steps of a fit() (the sharded data, the world
/// size, gradient accumulation, FitLength::iterations), and TrainState::planned_steps holds it;
/// a schedule never asks the user for it. A new schedule is one subclass overriding values_at().
///
/// With several param groups, the schedule's value is the first group's; the others keep their
/// ratio to it (as fastai's discriminative learning rates).
///
/// Every rank runs the schedule itself (the steps agree on every rank, so the rates do).
/// Its state (the base learning rate and momentum it started from) travels in checkpoints: a
/// resumed run continues the schedule exactly where it stood.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/hyperparameters.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <numbers>
#include <optional>
#include <vector>

namespace trainloop {

/// @brief Cosine annealing from `start` (position 0) to `end` (position 1), fastai's SchedCos.
inline double anneal_cos(double start, double end, double position) {
  return start + (1.0 + std::cos(std::numbers::pi * (1.0 - position))) * (end - start) / 2.0;
}

/// @brief A learning rate (and optionally a momentum) for one optimizer step.
struct ScheduledValues {
  double learning_rate = 0.0;      ///< the step's learning rate
  std::optional<double> momentum;  ///< the step's momentum (or Adam's beta1); none leaves it as it is
};

/// @brief Base of schedules that set the hyper-parameters of every optimizer step.
class StepSchedule : public Callback {
 public:
  /// @brief The values of step `step` (0-based, in [0, total_steps)) of a fit() of `total_steps`.
  /// `base` holds the optimizer's learning rate and momentum when the schedule first ran.
  virtual ScheduledValues values_at(int64_t step, int64_t total_steps, const ScheduledValues& base) const = 0;

  void on_fit_begin(TrainState& state) override {
    TRAINLOOP_CHECK(state.optimizer != nullptr, "a schedule needs the optimizer; the loop gave none");
    if (!base_) {
      base_ = ScheduledValues{learning_rate_of(*state.optimizer), momentum_of(*state.optimizer)};
      group_lrs_.clear();
      for (const auto& group : state.optimizer->param_groups()) group_lrs_.push_back(group.options().get_lr());
    }
    apply(state);  // the first step's values are in place before any hook reads them
  }
  void on_before_optimizer_step(TrainState& state) override { apply(state); }

  void save_state(torch::serialize::OutputArchive& archive) const override {
    if (!base_) return;
    archive.write("base_lr", torch::tensor(base_->learning_rate, torch::kFloat64));
    if (base_->momentum) archive.write("base_momentum", torch::tensor(*base_->momentum, torch::kFloat64));
    archive.write("group_lrs", torch::tensor(group_lrs_, torch::kFloat64));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor lr, momentum, groups;
    if (!archive.try_read("base_lr", lr)) return;
    base_ = ScheduledValues{lr.item<double>(), std::nullopt};
    if (archive.try_read("base_momentum", momentum)) base_->momentum = momentum.item<double>();
    group_lrs_.clear();
    if (archive.try_read("group_lrs", groups)) {
      group_lrs_.assign(groups.data_ptr<double>(), groups.data_ptr<double>() + groups.numel());
    }
  }

  /// @brief The optimizer's learning rate and momentum when the schedule first ran (none before).
  const std::optional<ScheduledValues>& base() const { return base_; }

 private:
  void apply(TrainState& state) {
    const int64_t total = std::max<int64_t>(state.planned_steps, 1);
    const int64_t step = std::clamp<int64_t>(state.step, 0, total - 1);
    const ScheduledValues values = values_at(step, total, *base_);
    // Param groups keep their ratios to the first one (fastai's slice(lo, hi), per-group rates).
    auto& groups = state.optimizer->param_groups();
    for (size_t g = 0; g < groups.size(); ++g) {
      const double ratio = g < group_lrs_.size() && group_lrs_[0] > 0.0 ? group_lrs_[g] / group_lrs_[0] : 1.0;
      groups[g].options().set_lr(values.learning_rate * ratio);
    }
    if (values.momentum) set_momentum(*state.optimizer, *values.momentum);
  }

  std::optional<ScheduledValues> base_;
  std::vector<double> group_lrs_;  // every param group's learning rate when the schedule first ran
};

}  // namespace trainloop
