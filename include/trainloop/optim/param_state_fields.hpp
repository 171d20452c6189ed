#pragma once
/// @file
/// @brief The per-parameter state of libtorch's per-element optimizers (SGD, Adam, AdamW, Adagrad,
/// RMSprop) by the names Python's optimizers give the same fields ("exp_avg", "momentum_buffer",
/// "step"...), so a checkpoint in torch.distributed.checkpoint's layout ("optim.state.<fqn>.<field>")
/// means the same in both worlds.
///
/// libtorch's states are plain classes without a field table, so the table is written here. The
/// step counter is an int64 in libtorch and a 0-d float tensor in Python; checkpoints store it as a
/// 0-d float64 tensor (exact to 2^53 steps; Python's float32 would round above 2^24).

#include <torch/torch.h>

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::optim {

/// @brief The state tensors of `state` that hold one value per element of their parameter, with
/// Python's names; undefined ones (Adam's max_exp_avg_sq without amsgrad) are listed too.
inline std::vector<std::pair<std::string, torch::Tensor*>> named_elementwise_fields(
    torch::optim::OptimizerParamState& state) {
  namespace o = torch::optim;
  if (auto* adamw = dynamic_cast<o::AdamWParamState*>(&state)) {
    return {{"exp_avg", &adamw->exp_avg()}, {"exp_avg_sq", &adamw->exp_avg_sq()}, {"max_exp_avg_sq", &adamw->max_exp_avg_sq()}};
  }
  if (auto* adam = dynamic_cast<o::AdamParamState*>(&state)) {
    return {{"exp_avg", &adam->exp_avg()}, {"exp_avg_sq", &adam->exp_avg_sq()}, {"max_exp_avg_sq", &adam->max_exp_avg_sq()}};
  }
  if (auto* sgd = dynamic_cast<o::SGDParamState*>(&state)) return {{"momentum_buffer", &sgd->momentum_buffer()}};
  if (auto* adagrad = dynamic_cast<o::AdagradParamState*>(&state)) return {{"sum", &adagrad->sum()}};
  if (auto* rmsprop = dynamic_cast<o::RMSpropParamState*>(&state)) {
    return {{"square_avg", &rmsprop->square_avg()}, {"momentum_buffer", &rmsprop->momentum_buffer()},
            {"grad_avg", &rmsprop->grad_avg()}};
  }
  return {};
}

/// @brief The step counter of `state`, for the optimizers that keep one (not SGD).
inline std::optional<int64_t> state_step(const torch::optim::OptimizerParamState& state) {
  namespace o = torch::optim;
  if (auto* adamw = dynamic_cast<const o::AdamWParamState*>(&state)) return adamw->step();
  if (auto* adam = dynamic_cast<const o::AdamParamState*>(&state)) return adam->step();
  if (auto* adagrad = dynamic_cast<const o::AdagradParamState*>(&state)) return adagrad->step();
  if (auto* rmsprop = dynamic_cast<const o::RMSpropParamState*>(&state)) return rmsprop->step();
  return std::nullopt;
}

/// @brief Sets the step counter of `state` (nothing for SGD, which keeps none).
inline void set_state_step(torch::optim::OptimizerParamState& state, int64_t step) {
  namespace o = torch::optim;
  if (auto* adamw = dynamic_cast<o::AdamWParamState*>(&state)) {
    adamw->step(step);
  } else if (auto* adam = dynamic_cast<o::AdamParamState*>(&state)) {
    adam->step(step);
  } else if (auto* adagrad = dynamic_cast<o::AdagradParamState*>(&state)) {
    adagrad->step(step);
  } else if (auto* rmsprop = dynamic_cast<o::RMSpropParamState*>(&state)) {
    rmsprop->step(step);
  }
}

/// @brief Whether `optimizer` is one of the five whose state this header names.
inline bool has_named_state_fields(const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  return dynamic_cast<const o::SGD*>(&optimizer) || dynamic_cast<const o::Adam*>(&optimizer) ||
         dynamic_cast<const o::AdamW*>(&optimizer) || dynamic_cast<const o::Adagrad*>(&optimizer) ||
         dynamic_cast<const o::RMSprop*>(&optimizer);
}

/// @brief An empty parameter state of `optimizer`'s type (one of the five), to fill from a checkpoint.
inline std::unique_ptr<torch::optim::OptimizerParamState> new_param_state(const torch::optim::Optimizer& optimizer) {
  namespace o = torch::optim;
  if (dynamic_cast<const o::AdamW*>(&optimizer)) return std::make_unique<o::AdamWParamState>();
  if (dynamic_cast<const o::Adam*>(&optimizer)) return std::make_unique<o::AdamParamState>();
  if (dynamic_cast<const o::SGD*>(&optimizer)) return std::make_unique<o::SGDParamState>();
  if (dynamic_cast<const o::Adagrad*>(&optimizer)) return std::make_unique<o::AdagradParamState>();
  return std::make_unique<o::RMSpropParamState>();  // callers check has_named_state_fields() first
}

}  // namespace trainloop::optim
