#pragma once
/// @file
/// @brief fine_tune(): fastai's Learner.fine_tune — a one-cycle with the body frozen, then a
/// one-cycle of the whole model with discriminative learning rates.
///
/// @code
/// trainloop::ParameterGroups groups(*model, trainloop::models::fastai_split("resnet50"));
/// auto optimizer = groups.make_optimizer<torch::optim::AdamW>(torch::optim::AdamWOptions(2e-3));
/// trainloop::TrainLoop loop(model, train, valid, optimizer, criterion);
/// trainloop::fine_tune(loop, groups, /*epochs=*/4, /*base_lr=*/2e-3);  // the loop's optimizer
/// @endcode
///
/// What it does, step for step as fastai's (fastai/callback/schedule.py):
///  1. freeze(): every group but the last frozen (normalization layers train, train_bn);
///     the optimizer's state cleared (Learner.freeze_to clears it);
///  2. fit_one_cycle(freeze_epochs, slice(base_lr), pct_start=0.99): group rates lr_range(slice(base_lr)),
///     each group's one-cycle peaking at its rate, div 25;
///  3. base_lr /= 2; unfreeze() (the optimizer's state cleared again);
///  4. fit_one_cycle(epochs, slice(base_lr / lr_mult, base_lr), pct_start, div): rates even_mults
///     from base_lr / lr_mult (first group) to base_lr (the head).
///
/// A function template over any loop with `fit(epochs, callbacks)`, not a TrainLoop member: it
/// needs nothing of the loop but fit() (and optimizer(), when not given the optimizer), so it
/// sits below train_loop.hpp in the include layers
/// and works for every gpu_mode (under DDP each fit() is one launch, and a spawned rank reruns
/// the same freeze and unfreeze, so every rank agrees on what is frozen).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/error.hpp>
#include <trainloop/finetune/freeze.hpp>
#include <trainloop/finetune/lr_range.hpp>
#include <trainloop/finetune/parameter_groups.hpp>
#include <trainloop/history.hpp>
#include <trainloop/schedules/one_cycle.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <concepts>
#include <cstdint>
#include <memory>

namespace trainloop {

/// @brief Options of fine_tune(); the defaults are fastai's.
struct FineTuneOptions {
  /// Epochs of the frozen phase (0 skips it).
  TORCH_ARG(int64_t, freeze_epochs) = 1;
  /// The unfrozen phase's rates run from base_lr / 2 / lr_mult (first group) to base_lr / 2 (last).
  TORCH_ARG(double, lr_mult) = 100.0;
  /// Warm-up fraction of the unfrozen phase's one-cycle (the frozen phase's is 0.99, as fastai's).
  TORCH_ARG(double, pct_start) = 0.3;
  /// The unfrozen phase's one-cycle starts at each group's peak / div (the frozen phase's at / 25).
  TORCH_ARG(double, div) = 5.0;
  /// Both phases end at each group's peak / div_final (fit_one_cycle's default).
  TORCH_ARG(double, div_final) = 1e5;
  /// Normalization layers train while the body is frozen (fastai's train_bn).
  TORCH_ARG(bool, train_bn) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::ConfigurationError naming the first option out of range.
  void validate() const {
    TRAINLOOP_CHECK(freeze_epochs_ >= 0, "fine_tune freeze_epochs is ", freeze_epochs_, "; expected 0 or more");
    TRAINLOOP_CHECK(lr_mult_ > 0.0, "fine_tune lr_mult is ", lr_mult_, "; expected a positive number");
    TRAINLOOP_CHECK(pct_start_ > 0.0 && pct_start_ < 1.0, "fine_tune pct_start is ", pct_start_,
                    "; expected a fraction in (0, 1)");
    TRAINLOOP_CHECK(div_ > 0.0, "fine_tune div is ", div_, "; expected a positive number");
    TRAINLOOP_CHECK(div_final_ > 0.0, "fine_tune div_final is ", div_final_, "; expected a positive number");
  }
};

/// @brief A loop fine_tune() can drive: `loop.fit(epochs, callbacks)` trains and returns the History.
template <class Loop>
concept FitLoop = requires(Loop& loop, int64_t epochs, const CallbackList& callbacks) {
  { loop.fit(epochs, callbacks) } -> std::convertible_to<History>;
};

/// @brief A loop that also says which optimizer it steps (`loop.optimizer()`, as TrainLoop does),
/// so fine_tune() need not be given it.
template <class Loop>
concept FitLoopWithOptimizer = FitLoop<Loop> && requires(Loop& loop) {
  { loop.optimizer() } -> std::convertible_to<torch::optim::Optimizer&>;
};

/// @brief fastai's fine_tune (see the file comment): a frozen one-cycle of freeze_epochs at
/// slice(base_lr), then an unfrozen one-cycle of `epochs` at slice(base_lr / 2 / lr_mult, base_lr / 2).
/// @param loop the loop (a TrainLoop, in any gpu_mode) training the model `groups` split
/// @param optimizer the loop's optimizer, built from groups.make_optimizer()
/// @param groups the model's parameter groups, body first, head last (two at least)
/// @param epochs epochs of the unfrozen phase
/// @param base_lr the head's peak learning rate of the frozen phase (twice the unfrozen phase's)
/// @param options freeze_epochs, lr_mult, pct_start, div, div_final, train_bn
/// @param callbacks given to both fit() calls, after the phase's OneCycle
/// @return the loop's History after the last phase (every epoch of both)
/// @throws trainloop::ConfigurationError, before anything is frozen, for options out of range or
///         an optimizer whose param groups are not `groups`.
template <FitLoop Loop>
History fine_tune(Loop& loop, torch::optim::Optimizer& optimizer, const ParameterGroups& groups, int64_t epochs,
                  double base_lr = 2e-3, const FineTuneOptions& options = FineTuneOptions(),
                  const CallbackList& callbacks = {}) {
  options.validate();
  TRAINLOOP_CHECK(epochs >= 1, "fine_tune epochs is ", epochs, "; expected 1 or more");
  TRAINLOOP_CHECK(base_lr > 0.0, "fine_tune base_lr is ", base_lr, "; expected a positive learning rate");
  TRAINLOOP_CHECK(groups.size() >= 2, "fine_tune was given ", groups.size(), " parameter group; expected at least ",
                  "two (a body to freeze and a head to train)");
  groups.check_matches(optimizer);
  // max_lr 0: each cycle peaks at the rates set just before it (group 0's, the others by ratio).
  const auto frozen_cycle =
      std::make_shared<OneCycle>(OneCycleOptions().pct_start(0.99).div_final(options.div_final()));
  const auto unfrozen_cycle = std::make_shared<OneCycle>(
      OneCycleOptions().pct_start(options.pct_start()).div(options.div()).div_final(options.div_final()));
  auto fit_one_cycle = [&](int64_t phase_epochs, const std::vector<double>& rates, std::shared_ptr<OneCycle> cycle) {
    set_learning_rates(optimizer, rates);
    CallbackList phase_callbacks{std::move(cycle)};
    phase_callbacks.insert(phase_callbacks.end(), callbacks.begin(), callbacks.end());
    return loop.fit(phase_epochs, phase_callbacks);
  };
  freeze(groups, FreezeOptions().train_bn(options.train_bn()));
  optimizer.state().clear();
  if (options.freeze_epochs() > 0) {
    fit_one_cycle(options.freeze_epochs(), lr_range(LrSlice(base_lr), groups.size()), frozen_cycle);
  }
  const double unfrozen_lr = base_lr / 2.0;
  unfreeze(groups);
  optimizer.state().clear();
  return fit_one_cycle(epochs, lr_range(LrSlice(unfrozen_lr / options.lr_mult(), unfrozen_lr), groups.size()),
                       unfrozen_cycle);
}

/// @brief fine_tune() with the optimizer the loop steps (TrainLoop::optimizer()):
/// `fine_tune(loop, groups, 4, 2e-3)` does what `fine_tune(loop, optimizer, groups, 4, 2e-3)` does.
/// The parameters are those of the overload that takes the optimizer.
template <FitLoopWithOptimizer Loop>
History fine_tune(Loop& loop, const ParameterGroups& groups, int64_t epochs, double base_lr = 2e-3,
                  const FineTuneOptions& options = FineTuneOptions(), const CallbackList& callbacks = {}) {
  return fine_tune(loop, loop.optimizer(), groups, epochs, base_lr, options, callbacks);
}

}  // namespace trainloop
