#pragma once
/// @file
/// @brief Reads and sets the learning rate and the momentum of an optimizer's param groups,
/// whatever the optimizer: the momentum is SGD's and RMSprop's `momentum`, Adam's and AdamW's
/// beta1 (fastai and PyTorch's OneCycleLR cycle the same quantities).

#include <torch/torch.h>

#include <optional>
#include <tuple>

namespace trainloop {

/// @brief The learning rate of param group `group` (0: the first).
inline double learning_rate_of(const torch::optim::Optimizer& optimizer, size_t group = 0) {
  return optimizer.param_groups().at(group).options().get_lr();
}

/// @brief Sets the learning rate of every param group.
inline void set_learning_rate(torch::optim::Optimizer& optimizer, double lr) {
  for (auto& group : optimizer.param_groups()) group.options().set_lr(lr);
}

/// @brief The momentum (SGD, RMSprop) or beta1 (Adam, AdamW) of param group `group`; none for an
/// optimizer without one (Adagrad, LBFGS, a user's own).
inline std::optional<double> momentum_of(const torch::optim::Optimizer& optimizer, size_t group = 0) {
  auto& options = optimizer.param_groups().at(group).options();
  if (auto* sgd = dynamic_cast<const torch::optim::SGDOptions*>(&options)) return sgd->momentum();
  if (auto* adam = dynamic_cast<const torch::optim::AdamOptions*>(&options)) return std::get<0>(adam->betas());
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWOptions*>(&options)) return std::get<0>(adamw->betas());
  if (auto* rms = dynamic_cast<const torch::optim::RMSpropOptions*>(&options)) return rms->momentum();
  return std::nullopt;
}

/// @brief Sets the momentum (or beta1) of every param group; false when the optimizer has none.
inline bool set_momentum(torch::optim::Optimizer& optimizer, double momentum) {
  bool set = false;
  for (auto& group : optimizer.param_groups()) {
    auto& options = group.options();
    if (auto* sgd = dynamic_cast<torch::optim::SGDOptions*>(&options)) {
      sgd->momentum(momentum);
      set = true;
    } else if (auto* adam = dynamic_cast<torch::optim::AdamOptions*>(&options)) {
      adam->betas({momentum, std::get<1>(adam->betas())});
      set = true;
    } else if (auto* adamw = dynamic_cast<torch::optim::AdamWOptions*>(&options)) {
      adamw->betas({momentum, std::get<1>(adamw->betas())});
      set = true;
    } else if (auto* rms = dynamic_cast<torch::optim::RMSpropOptions*>(&options)) {
      rms->momentum(momentum);
      set = true;
    }
  }
  return set;
}

}  // namespace trainloop
