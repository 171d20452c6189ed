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
#include <utility>

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

/// Sets the optimizer's state aside while `use` runs and puts it back after (also on an exception):
/// what a file of the param groups alone writes or reads (save_optimizer_groups, load_optimizer_options).
template <class Use>
void with_optimizer_state_aside(torch::optim::Optimizer& optimizer, Use&& use) {
  auto state = std::move(optimizer.state());
  optimizer.state().clear();
  struct PutBack {
    torch::optim::Optimizer& optimizer;
    decltype(state)& saved;
    ~PutBack() { optimizer.state() = std::move(saved); }
  } put_back{optimizer, state};
  use();
}

/// The optimizer's param groups and options in libtorch's format, without its state (which a
/// per-rank checkpoint holds in the ranks' files): the state is moved out while libtorch writes.
inline void save_optimizer_groups(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive) {
  with_optimizer_state_aside(optimizer, [&] { optimizer.save(archive); });
}

/// Applies the param groups' options of `archive` (what save_optimizer_groups() or
/// save_optimizer_state() wrote) and keeps the optimizer's state as it is: elastic training's
/// survivors hold the committed state already (loop/checkpoint_io.hpp, keeps_model_and_optimizer).
inline void load_optimizer_options(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
  with_optimizer_state_aside(optimizer, [&] { load_optimizer_state(optimizer, archive); });
}

}  // namespace trainloop::detail
