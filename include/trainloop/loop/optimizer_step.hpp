#pragma once
/// @file
/// @brief One optimizer step of the loop, in every mode: finish the gradient reduction, fp16's
/// unscale and agreed skip, clipping, the callbacks' last look, the step, the scaler's update.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/optim/hyperparameters.hpp>
#include <trainloop/precision/grad_scaler.hpp>

#include <torch/torch.h>

#include <optional>

namespace trainloop::detail {

/// The learning rate and momentum a step used (for the History).
struct StepHyperparameters {
  double learning_rate = 0.0;
  std::optional<double> momentum;
};

/// Runs one optimizer step after the last micro-batch of an accumulation window. With fp16 a
/// step whose gradients overflowed is skipped on every rank (they agree), and the scaler adapts.
template <class Engine, class Module>
StepHyperparameters optimizer_step(Engine& engine, Module& module, torch::optim::Optimizer& optimizer,
                                   std::optional<GradScaler>& scaler, double clip_grad_norm,
                                   const CallbackList& active, TrainState& state) {
  engine.before_optimizer_step();
  // fp16: unscale before clipping; a step with inf/NaN gradients is skipped on every rank —
  // agreed by a collective, unless the ranks' gradients are identical (then so is the finding).
  bool overflow = scaler && scaler->unscale(module.parameters());
  if (scaler && !ranks_hold_same_gradients(engine)) overflow = engine.any_rank(overflow);
  if (clip_grad_norm > 0.0 && !overflow) clip_gradients(engine, module, clip_grad_norm);
  for (auto& cb : active) cb->on_before_optimizer_step(state);
  const StepHyperparameters used{learning_rate_of(optimizer), momentum_of(optimizer)};
  if (!overflow) step_optimizer(engine, optimizer);
  if (scaler) {
    scaler->update(overflow);
    state.skipped_steps = scaler->skipped_steps();
  }
  engine.after_optimizer_step();
  zero_gradients(engine, optimizer);  // DDP keeps the tensors (gradients as bucket views)
  return used;
}

}  // namespace trainloop::detail
