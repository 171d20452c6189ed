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
/// | stepped_parameters(module)                        | the tensors the step updates, whose gradients fp16    |
/// |                                                   | unscales. Default: module.parameters() (a sharded     |
/// |                                                   | mode: its pieces, with their reduced chunks)          |
/// | clip_grad_norm(module, max_norm)                  | clipping, on every rank: the norm over every rank's   |
/// |                                                   | gradients (a collective). Default: the local norm     |
/// | step_optimizer(optimizer)                         | the optimizer step, on every rank (not on a step fp16 |
/// |                                                   | skips): this rank's share, then share the result.     |
/// |                                                   | Default: optimizer.step()                             |
/// | zero_grad(optimizer)                              | after each step (DDP keeps the tensors: bucket        |
/// |                                                   | views). Default: optimizer.zero_grad()                |
/// | save_optimizer_state(optimizer, archive, writes)  | writing a checkpoint, on every rank (a collective);   |
/// |                                                   | fills `archive` where `writes` (rank 0) is true.      |
/// |                                                   | Default: the writer saves libtorch's format           |
/// | load_optimizer_state(optimizer, archive)          | resuming, on every rank; throws when the state does   |
/// |                                                   | not fit (the loop then puts the previous state back). |
/// |                                                   | Default: checked and loaded in libtorch's format      |
/// | unshard_parameters()                              | every parameter whole on every rank (a collective):   |
/// |                                                   | before writing a checkpoint, before evaluation or     |
/// |                                                   | prediction not in lockstep, and when a callback asks  |
/// |                                                   | (TrainState::gather_whole_weights). A mode that keeps |
/// |                                                   | a share of the parameters between uses defines it     |
/// |                                                   | (fsdp at full). Default: nothing                      |
/// | reshard_parameters()                              | frees what unshard_parameters() gathered, keeping     |
/// |                                                   | changes (TrainState::free_whole_weights). Default:    |
/// |                                                   | nothing                                               |
/// | evaluates_in_lockstep()                           | true: evaluation's batches are collectives (fsdp at   |
/// |                                                   | full gathers units as operators read them), so every  |
/// |                                                   | rank runs as many (loop/evaluation.hpp: one all-gather|
/// |                                                   | of the counts; a rank out of batches runs a discarded |
/// |                                                   | forward). Default: false                              |
/// | parameter_shares(), load_parameter_shares(shares) | copies of this rank's shares of the parameters        |
/// |                                                   | (std::optional: none while they are whole) and        |
/// |                                                   | putting them back (TrainState::copy_own_weights,      |
/// |                                                   | EarlyStopping's best weights). Default: whole copies  |
/// | run_fit(actions, resume)                          | wraps a whole fit (DDP launches ranks or ends a       |
/// |                                                   | spawned one). Default: actions.train(resume)          |
/// | cannot_train (static text)                        | what the mode says about a model or batch it cannot   |
/// |                                                   | train (engine_cannot_train_text, mode_engine.hpp)     |
///
/// Sharded modes: Single, DataParallel and plain DDP keep the whole reduced gradient and the whole
/// optimizer state on every rank, so the loop can clip by the local norm and let rank 0 write its
/// optimizer. A sharded mode cannot: its rank r holds only shard r of the optimizer state (DDP
/// with ZeRO-1) and perhaps of the gradients; it defines clip_grad_norm, step_optimizer and the
/// two checkpoint members (FullyShardedDataParallel also stepped_parameters, the members of whole
/// and shared parameters and evaluates_in_lockstep).
///
/// The archive is the checkpoint's `__trainloop__/optimizer` entry; a sharded engine chooses its
/// layout (for example one sub-archive per rank, or the shards gathered into libtorch's layout so
/// that a run with another world size resumes from it). An archive in libtorch's layout is checked
/// against the optimizer before the engine's loader runs; one in the engine's own layout is the
/// loader's to check. Checked by tests/test_user_mode.cpp; DDP's ZeRO-1
/// (distributed/zero/zero_optimizer_shard.hpp) uses step_optimizer and both checkpoint members;
/// gpu_mode::FullyShardedDataParallel fills every seam of the step (its gradients are chunks) and
/// defines the parameter members (tests/test_sharded_evaluation.cpp).

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

/// The tensors the optimizer step updates, whose gradients fp16 unscales: the engine's
/// stepped_parameters when it has one (a sharded mode's pieces), otherwise the model's parameters.
template <class Engine, class Module>
std::vector<torch::Tensor> stepped_parameters(Engine& engine, Module& module) {
  if constexpr (requires { { engine.stepped_parameters(module) } -> std::convertible_to<std::vector<torch::Tensor>>; }) {
    return engine.stepped_parameters(module);
  } else {
    return module.parameters();
  }
}

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

/// Every parameter of the model whole on this rank: the engine's unshard_parameters() when it
/// has one (a collective: every rank calls it at the same point), nothing otherwise.
template <class Engine>
void unshard_parameters(Engine& engine) {
  if constexpr (requires { engine.unshard_parameters(); }) engine.unshard_parameters();
}

/// Frees what unshard_parameters() gathered, keeping what changed in it: the engine's
/// reshard_parameters() when it has one (no collective), nothing otherwise.
template <class Engine>
void reshard_parameters(Engine& engine) {
  if constexpr (requires { engine.reshard_parameters(); }) engine.reshard_parameters();
}

/// Whether every rank must run as many evaluation batches (the engine's evaluates_in_lockstep());
/// false by default.
template <class Engine>
bool evaluates_in_lockstep(Engine& engine) {
  if constexpr (requires { { engine.evaluates_in_lockstep() } -> std::convertible_to<bool>; }) {
    return engine.evaluates_in_lockstep();
  } else {
    return false;
  }
}

/// Copies of this rank's shares of the parameters when the engine keeps shares now (its
/// parameter_shares()), else nothing: the parameters are whole.
template <class Engine>
std::optional<std::vector<torch::Tensor>> parameter_shares(Engine& engine) {
  if constexpr (requires { { engine.parameter_shares() } -> std::convertible_to<std::optional<std::vector<torch::Tensor>>>; }) {
    return engine.parameter_shares();
  } else {
    return std::nullopt;
  }
}

/// Puts shares parameter_shares() returned back (the engine's load_parameter_shares).
/// @throws trainloop::Error for an engine that keeps no shares.
template <class Engine>
void load_parameter_shares(Engine& engine, const std::vector<torch::Tensor>& shares) {
  if constexpr (requires { engine.load_parameter_shares(shares); }) {
    engine.load_parameter_shares(shares);
  } else {
    throw Error("trainloop: parameter shares were put back in a mode that keeps none; expected the mode that made them");
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
