#pragma once
/// @file
/// @brief Saving and loading an optimizer's complete state, its param-group options included.
///
/// libtorch's `Optimizer::load` (1.13, torch/optim/serialize.h) reads each param group's saved
/// options (lr, betas, weight decay, momentum...) but never applies them: a loaded optimizer keeps
/// the options it was constructed with. A learning rate lowered before saving came back as the
/// old one (measured: the ranks of a spawned DDP fit trained with the old lr, max |param diff|
/// 0.31 against one process). load_optimizer_state() applies them, through the options' own
/// virtual serialize(), so every optimizer type (and a user's own options type) is covered.

#include <torch/torch.h>

#include <cstdint>
#include <string>

namespace trainloop::detail {

/// Writes `optimizer`'s state and param groups into `archive` (libtorch's own format).
inline void save_optimizer_state(const torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive) {
  optimizer.save(archive);
}

/// Loads what save_optimizer_state() wrote, then applies every param group's saved options.
/// The saved state replaces the optimizer's: libtorch's load only overwrites the entries it has,
/// so momentum buffers made after a state without them (saved before the first step) would survive.
inline void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  optimizer.state().clear();
  optimizer.load(archive);
  torch::serialize::InputArchive groups;
  if (!archive.try_read("param_groups", groups)) return;
  torch::Tensor count;
  if (!groups.try_read("param_groups/size", count)) return;
  const int64_t saved = count.item<int64_t>();
  auto& param_groups = optimizer.param_groups();
  for (int64_t i = 0; i < saved && i < static_cast<int64_t>(param_groups.size()); ++i) {
    torch::serialize::InputArchive group, options;
    if (groups.try_read("param_groups/" + std::to_string(i), group) && group.try_read("options", options)) {
      param_groups[static_cast<size_t>(i)].options().serialize(options);
    }
  }
}

}  // namespace trainloop::detail
