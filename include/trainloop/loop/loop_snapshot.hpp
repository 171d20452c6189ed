#pragma once
/// @file
/// @brief An in-memory copy of everything training changes (weights and buffers, optimizer state
/// and options, progress, this process's random streams), to put a loop back after a trial run
/// such as lr_find(). Per process, so it needs no shared file system under DDP.

#include <trainloop/checkpoint/rng_state.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/checkpoint/training_progress.hpp>

#include <trainloop/detail/module_tensors.hpp>

#include <torch/torch.h>

#include <sstream>
#include <vector>

namespace trainloop::detail {

/// What a trial run may change, copied; restore() puts it back.
class LoopSnapshot {
 public:
  LoopSnapshot(torch::nn::Module& module, torch::optim::Optimizer& optimizer, const TrainingProgress& progress)
      : progress_(progress), rng_(capture_rng_state()) {
    torch::NoGradGuard no_grad;
    for (const auto& t : detail::state_tensors(module)) tensors_.push_back(t.detach().clone());
    torch::serialize::OutputArchive archive;
    save_optimizer_state(optimizer, archive);
    archive.save_to(optimizer_bytes_);
    if (progress_.partial_totals.defined()) progress_.partial_totals = progress_.partial_totals.clone();
    if (progress_.grad_scaler_state.defined()) progress_.grad_scaler_state = progress_.grad_scaler_state.clone();
  }

  /// Puts the module, optimizer, progress and random streams back as they were.
  void restore(torch::nn::Module& module, torch::optim::Optimizer& optimizer, TrainingProgress& progress) const {
    {
      torch::NoGradGuard no_grad;
      auto targets = detail::state_tensors(module);
      for (size_t i = 0; i < targets.size() && i < tensors_.size(); ++i) targets[i].copy_(tensors_[i]);
    }
    std::istringstream bytes(optimizer_bytes_.str());
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    load_optimizer_state(optimizer, archive);
    progress = progress_;
    restore_rng_state(rng_);
  }

 private:

  std::vector<torch::Tensor> tensors_;
  std::ostringstream optimizer_bytes_;
  TrainingProgress progress_;
  torch::Tensor rng_;
};

}  // namespace trainloop::detail
