#pragma once
/// @file
/// @brief One optimizer step as one engine call: the loop asks `run_optimizer_step(engine,
/// request)` once per accumulation window; an engine with an `optimizer_step(request)` member
/// does the whole step itself, any other gets `default_optimizer_step`, the sequence every
/// built-in mode uses (it calls the engine's finer optional members, engine/optional_members.hpp):
///
/// 1. `before_optimizer_step()` — the mode finishes its gradient reduction;
/// 2. fp16: unscale the stepped tensors' gradients (`stepped_parameters`: the model's parameters,
///    or what a sharded mode steps instead); a step whose gradients overflowed is skipped on every
///    rank (agreed by a collective unless `gradients_agree()` says every rank holds the same gradients);
/// 3. clipping (`clip_grad_norm`, the engine's or the local norm);
/// 4. `request.before_step()` — the callbacks' `on_before_optimizer_step` (a schedule sets the
///    learning rate here, so the rate returned is read after it);
/// 5. the step (`step_optimizer`), unless skipped; fp16's scaler adapts;
/// 6. `after_optimizer_step()` (replicas refresh), then the gradients are cleared (`zero_grad`).
///
/// Every built-in mode steps through this sequence, the sharded one too: it fills the seams
/// (stepped_parameters, clip_grad_norm, step_optimizer) with its pieces. A mode that needs
/// something around the step can still define `optimizer_step(request)` and call
/// `default_optimizer_step(*this, request)` inside it.

#include <trainloop/engine/optional_members.hpp>
#include <trainloop/optim/hyperparameters.hpp>
#include <trainloop/precision/grad_scaler.hpp>

#include <torch/torch.h>

#include <concepts>
#include <functional>
#include <optional>

namespace trainloop {

/// @brief What one optimizer step needs from the loop.
template <class Module>
struct OptimizerStepRequest {
  Module& module;                         ///< the model whose gradients are stepped
  torch::optim::Optimizer& optimizer;     ///< the user's optimizer
  GradScaler* scaler = nullptr;           ///< fp16's loss scaler; null in fp32 and bf16
  double clip_grad_norm = 0.0;            ///< clip to this total norm; 0: no clipping
  std::function<void()> before_step;      ///< the callbacks' last look before the step (may be empty)
};

/// @brief What a step did: the hyper-parameters it used (for the History) and whether fp16
/// skipped it.
struct OptimizerStepResult {
  double learning_rate = 0.0;     ///< of the first param group, as the step used it
  std::optional<double> momentum; ///< its momentum or beta1, if the optimizer has one
  bool skipped = false;           ///< fp16 found inf/NaN gradients: nothing was stepped
};

/// @brief The optimizer step of every built-in mode (the sequence in the file comment).
template <class Engine, class Module>
OptimizerStepResult default_optimizer_step(Engine& engine, const OptimizerStepRequest<Module>& request) {
  engine.before_optimizer_step();
  GradScaler* scaler = request.scaler;
  bool overflow = scaler != nullptr && scaler->unscale(detail::stepped_parameters(engine, request.module));
  if (scaler != nullptr && !detail::ranks_hold_same_gradients(engine)) overflow = engine.any_rank(overflow);
  if (request.clip_grad_norm > 0.0 && !overflow) detail::clip_gradients(engine, request.module, request.clip_grad_norm);
  if (request.before_step) request.before_step();
  OptimizerStepResult result{learning_rate_of(request.optimizer), momentum_of(request.optimizer), overflow};
  if (!overflow) detail::step_optimizer(engine, request.optimizer);
  if (scaler != nullptr) scaler->update(overflow);
  engine.after_optimizer_step();
  detail::zero_gradients(engine, request.optimizer);  // DDP keeps the tensors (gradients as bucket views)
  return result;
}

namespace detail {

/// The loop's one call per step: the engine's optimizer_step when it has one, else the default.
template <class Engine, class Module>
OptimizerStepResult run_optimizer_step(Engine& engine, const OptimizerStepRequest<Module>& request) {
  if constexpr (requires { { engine.optimizer_step(request) } -> std::convertible_to<OptimizerStepResult>; }) {
    return engine.optimizer_step(request);
  } else {
    return default_optimizer_step(engine, request);
  }
}

}  // namespace detail
}  // namespace trainloop
