#pragma once
/// @file
/// @brief freeze() and unfreeze() by module name, as fastai's Learner.freeze: frozen parameters
/// stop requiring gradients, normalization layers stay trainable (fastai's `train_bn`).
///
/// @code
/// trainloop::freeze(*net, {"fc"});  // only fc and every BatchNorm train
/// loop.fit(1);
/// trainloop::unfreeze(*net);
/// loop.fit(3);
/// @endcode
///
/// A frozen parameter has no gradient at all: freezing drops the gradient it held, so no
/// optimizer moves it (libtorch's optimizers skip parameters without a gradient; a zero gradient
/// would still feed momentum and weight decay). Every mode follows the flags: DataParallel's
/// replicas take them from the model, DDP's gradient reducer waits only for parameters that
/// require grad and is rebuilt when that set changes. Under DDP every rank must freeze the same
/// parameters (the same program does; a spawned rank reruns it). The flags are not part of a
/// checkpoint: freeze again before a resumed fit(), as the program did before the first one.
///
/// fastai's Learner.freeze also clears the optimizer's state (momentum buffers, Adam's moments);
/// call `optimizer.state().clear()` for that. fine_tune() does.

#include <trainloop/finetune/parameter_selection.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <string>
#include <vector>

namespace trainloop {

/// @brief How freeze() treats normalization layers.
struct FreezeOptions {
  /// Keep the parameters of normalization layers (BatchNorm, InstanceNorm, LayerNorm,
  /// SyncBatchNorm) trainable in frozen parts, as fastai's `train_bn` (its default too).
  TORCH_ARG(bool, train_bn) = true;
};

namespace detail {

/// Sets `parameter`'s flag; a parameter made frozen loses its gradient.
inline void set_trainable(const torch::Tensor& parameter, bool trainable) {
  if (parameter.requires_grad() != trainable) parameter.set_requires_grad(trainable);
  if (!trainable) parameter.mutable_grad().reset();
}

}  // namespace detail

/// @brief Freezes `module` except the parameters under `trainable_prefixes` (module names such
/// as "fc" or "layer4.1") and, with FreezeOptions::train_bn, those of normalization layers.
/// Parameters under the prefixes are made trainable again if an earlier freeze() froze them.
/// @throws trainloop::ConfigurationError naming a prefix that is no module or parameter of
///         `module`, with the names that exist.
inline void freeze(torch::nn::Module& module, const std::vector<std::string>& trainable_prefixes,
                   const FreezeOptions& options = FreezeOptions()) {
  detail::check_prefixes(module, trainable_prefixes);
  for (const auto& parameter : detail::named_parameters_of(module)) {
    bool trainable = options.train_bn() && parameter.normalization;
    for (const auto& prefix : trainable_prefixes) trainable = trainable || detail::under_prefix(parameter.name, prefix);
    detail::set_trainable(parameter.tensor, trainable);
  }
}

/// @brief Makes every parameter of `module` trainable (requires grad).
inline void unfreeze(torch::nn::Module& module) {
  for (const auto& parameter : module.parameters(/*recurse=*/true)) detail::set_trainable(parameter, true);
}

/// @brief The names of the parameters of `module` that require grad, in named_parameters() order
/// (fastai's trainable_params, by name).
inline std::vector<std::string> trainable_parameter_names(const torch::nn::Module& module) {
  std::vector<std::string> names;
  for (const auto& parameter : detail::named_parameters_of(module)) {
    if (parameter.tensor.requires_grad()) names.push_back(parameter.name);
  }
  return names;
}

}  // namespace trainloop
