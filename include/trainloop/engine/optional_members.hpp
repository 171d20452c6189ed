#pragma once
/// @file
/// @brief Every optional member of a mode engine, and what the loop does for an engine without
/// it: the one place to read when writing a mode (the required members are ModeEngine's, in
/// engine/mode_engine.hpp). The loop calls these functions, never the members directly.
///
/// | member                                            | the loop calls it / default without it                |
/// |---------------------------------------------------|-------------------------------------------------------|
/// | optimizer_step(request)                           | once per accumulation window: the whole step. Default:|
/// |                                                   | default_optimizer_step (engine/optimizer_step.hpp),   |
/// |                                                   | which calls the members below                         |
/// | train_without_samples(sync)                       | a rank without samples in an exact uneven micro-batch |
/// |                                                   | still joins the reduction. Default: shards are padded |
/// |                                                   | (TrainsWithoutSamples; loop/epoch_batch_plan.hpp)     |
/// | gradients_agree()                                 | true: every rank holds identical gradients after      |
/// |                                                   | before_optimizer_step(), so fp16's overflow check     |
/// |                                                   | needs no any_rank(). Default: false (ranks agree)     |
/// | zero_grad(optimizer)                              | after each step (DDP keeps the tensors: bucket        |
/// |                                                   | views). Default: optimizer.zero_grad()                |
/// | save_optimizer_state(optimizer, archive, writes)  | writing a checkpoint, on every rank (a collective);   |
/// |                                                   | fills `archive` where `writes` (rank 0) is true.      |
/// |                                                   | Default: the writer saves libtorch's format           |
/// | load_optimizer_state(optimizer, archive)          | resuming, on every rank; throws when the state does   |
/// |                                                   | not fit (the loop then puts the previous state back). |
/// |                                                   | Default: checked and loaded in libtorch's format      |
/// | run_fit(actions, resume)                          | wraps a whole fit (DDP launches ranks or ends a       |
/// |                                                   | spawned one). Default: actions.train(resume)          |
/// | cannot_train (static text)                        | what the mode says about a model or batch it cannot   |
/// |                                                   | train (engine_cannot_train_text, mode_engine.hpp)     |
///
/// The members only a mode that shards state defines (its optimizer state, gradients or
/// parameters split over the ranks) are one capability with its own table and the replicated
/// default for each: engine/sharded_members.hpp, included here.
///
/// The archive is the checkpoint's `__trainloop__/optimizer` entry; a sharded engine chooses its
/// layout (for example one sub-archive per rank, or the shards gathered into libtorch's layout so
/// that a run with another world size resumes from it). An archive in libtorch's layout is checked
/// against the optimizer before the engine's loader runs; one in the engine's own layout is the
/// loader's to check. Checked by tests/test_user_mode.cpp; DDP's ZeRO-1
/// (distributed/zero/zero_optimizer_shard.hpp) uses step_optimizer and both checkpoint members;
/// gpu_mode::FullyShardedDataParallel fills every seam of the step (its gradients are chunks) and
/// defines the parameter members (tests/test_sharded_evaluation.cpp).

#include <trainloop/engine/sharded_members.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/optimizer_state.hpp>

#include <torch/torch.h>

#include <concepts>
#include <functional>
#include <optional>
#include <vector>

namespace trainloop::detail {

/// Whether `Engine` can take part in a gradient reduction without samples
/// (`engine.train_without_samples(synchronize)`), which exact uneven batches need.
template <class Engine>
concept TrainsWithoutSamples = requires(Engine& engine, bool synchronize) {
  engine.train_without_samples(synchronize);
};

/// Whether every rank holds identical gradients after before_optimizer_step() (the engine says
/// so with gradients_agree()); false by default, so the ranks agree through a collective.
template <class Engine>
bool ranks_hold_same_gradients(Engine& engine) {
  if constexpr (requires { engine.gradients_agree(); }) {
    return engine.gradients_agree();
  } else {
    return false;
  }
}

/// Clears the gradients after a step: the engine's zero_grad when it has one, else the optimizer's.
template <class Engine>
void zero_gradients(Engine& engine, torch::optim::Optimizer& optimizer) {
  if constexpr (requires { engine.zero_grad(optimizer); }) {
    engine.zero_grad(optimizer);
  } else {
    optimizer.zero_grad();
  }
}

/// The optimizer part of a checkpoint, on every rank: the engine's save_optimizer_state when it
/// has one (a collective), otherwise the writing rank's optimizer in libtorch's format.
template <class Engine>
void save_engine_optimizer_state(Engine& engine, torch::optim::Optimizer& optimizer,
                                 torch::serialize::OutputArchive& archive, bool writes) {
  if constexpr (requires { engine.save_optimizer_state(optimizer, archive, writes); }) {
    engine.save_optimizer_state(optimizer, archive, writes);
  } else if (writes) {
    save_optimizer_state(optimizer, archive);
  }
}

/// Loads a checkpoint's optimizer archive into a rank's optimizer.
using OptimizerStateLoader = std::function<void(torch::optim::Optimizer&, torch::serialize::InputArchive&)>;

/// The engine's load_optimizer_state as a loader, or an empty one (the checkpoint reader then
/// checks the state against the optimizer and loads libtorch's format).
template <class Engine>
OptimizerStateLoader engine_optimizer_loader(Engine& engine) {
  if constexpr (requires(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
                  engine.load_optimizer_state(optimizer, archive);
                }) {
    return [&engine](torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
      engine.load_optimizer_state(optimizer, archive);
    };
  } else {
    return {};
  }
}

}  // namespace trainloop::detail
