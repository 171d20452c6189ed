#pragma once
/// @file
/// @brief Moves a model's and an optimizer's state between the launching process and its ranks,
/// through files in a directory they share.
///
/// Before spawning, the launcher saves the caller's model and optimizer, and every rank starts
/// from them — so a model initialised without a seed still trains from the caller's weights, and
/// an optimizer whose options the caller changed (a lowered lr) trains with the new options.
/// After training, local rank 0 of each node saves its state (identical on every rank) and the
/// launcher loads it into the caller's model, so fit() returns a trained model.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/optimizer_state.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <filesystem>
#include <string>

namespace trainloop::dist {

/// @brief Saves `module` and `optimizer` as `<dir>/<name>.model.pt` and `<dir>/<name>.optimizer.pt`,
/// each written atomically.
inline void save_training_state(const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
                                const std::filesystem::path& dir, const std::string& name) {
  auto write = [&](const std::string& suffix, const char* what, auto&& save) {
    torch::serialize::OutputArchive archive;
    save(archive);
    ::trainloop::detail::AtomicFile file(dir / (name + suffix), what);
    archive.save_to(file.temporary().string());
    file.commit();
  };
  write(".model.pt", "the model state", [&](auto& archive) { module.save(archive); });
  write(".optimizer.pt", "the optimizer state",
        [&](auto& archive) { ::trainloop::detail::save_optimizer_state(optimizer, archive); });
}

/// @brief True when save_training_state() wrote a state called `name` into `dir`.
inline bool has_training_state(const std::filesystem::path& dir, const std::string& name) {
  return std::filesystem::exists(dir / (name + ".model.pt")) && std::filesystem::exists(dir / (name + ".optimizer.pt"));
}

/// @brief Loads what save_training_state() wrote into `module` (on its own device) and
/// `optimizer`, param-group options (lr, betas, ...) included.
inline void load_training_state(torch::nn::Module& module, torch::optim::Optimizer& optimizer,
                                const std::filesystem::path& dir, const std::string& name) {
  auto model_path = dir / (name + ".model.pt");
  TRAINLOOP_CHECK(std::filesystem::exists(model_path), "the model state ", model_path.string(),
                  " is missing; expected the launcher or rank 0 to have written it");
  c10::optional<torch::Device> device;  // c10::optional is std::optional in 2.x, its own type in 1.13
  auto parameters = module.parameters();
  if (!parameters.empty()) device = parameters.front().device();
  torch::serialize::InputArchive model_archive;
  model_archive.load_from(model_path.string(), device);
  module.load(model_archive);
  torch::serialize::InputArchive optimizer_archive;
  optimizer_archive.load_from((dir / (name + ".optimizer.pt")).string(), device);
  ::trainloop::detail::load_optimizer_state(optimizer, optimizer_archive);
}

}  // namespace trainloop::dist
