#pragma once
/// @file
/// @brief The members an engine defines when its ranks hold *parts* of the training state (a
/// sharded mode: ZeRO, FSDP), and what the loop does for an engine that does not define them.
///
/// Single, DataParallel and plain DDP keep the whole reduced gradient and the whole optimizer
/// state on every rank, so the loop can clip by the local norm and let rank 0 write its
/// optimizer. A sharded mode cannot: its rank r holds only shard r of the optimizer state (DDP
/// with ZeRO-1) and perhaps of the gradients. It defines, all optional:
///
/// | member                                            | when the loop calls it                                |
/// |---------------------------------------------------|-------------------------------------------------------|
/// | clip_grad_norm(module, max_norm)                  | clipping, on every rank: clip by the norm over every  |
/// |                                                   | rank's gradients (a collective)                       |
/// | save_optimizer_state(optimizer, archive, writes)  | writing a checkpoint, on every rank (a collective);   |
/// |                                                   | fills `archive` where `writes` (rank 0) is true       |
/// | step_optimizer(optimizer)                         | the optimizer step, on every rank (not on a step fp16 |
/// |                                                   | skips): step this rank's share and share the result   |
/// | load_optimizer_state(optimizer, archive)          | resuming, on every rank, with the archive the checkpoint holds; |
/// |                                                   | throws when it does not fit (nothing changed then: the loop keeps |
/// |                                                   | the optimizer's previous state and puts it back)      |
///
/// The archive is the checkpoint's `__trainloop__/optimizer` entry; a sharded engine chooses its
/// layout (for example one sub-archive per rank, or the shards gathered into libtorch's layout so
/// that a run with another world size resumes from it). An archive in libtorch's layout is checked
/// against the optimizer before the engine's loader runs; one in the engine's own layout is the
/// loader's to check. Checked by tests/test_user_mode.cpp; DDP's ZeRO
/// (distributed/zero/zero_optimizer_shard.hpp) uses step_optimizer and both checkpoint members.

#include <trainloop/optim/optimizer_state.hpp>

#include <torch/torch.h>

#include <functional>

namespace trainloop::detail {

/// Clips the gradients of `module` to a total norm of `max_norm`: the engine's clip_grad_norm
/// when it has one, otherwise the local norm (every rank holds the whole reduced gradient).
template <class Engine, class Module>
void clip_gradients(Engine& engine, Module& module, double max_norm) {
  if constexpr (requires { engine.clip_grad_norm(module, max_norm); }) {
    engine.clip_grad_norm(module, max_norm);
  } else {
    torch::nn::utils::clip_grad_norm_(module.parameters(), max_norm);
  }
}

/// One optimizer step: the engine's step_optimizer when it has one (a sharded mode steps its
/// share, a collective), otherwise `optimizer.step()`.
template <class Engine>
void step_optimizer(Engine& engine, torch::optim::Optimizer& optimizer) {
  if constexpr (requires { engine.step_optimizer(optimizer); }) {
    engine.step_optimizer(optimizer);
  } else {
    optimizer.step();
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
