#pragma once
/// @file
/// @brief The sharded capability: the optional engine members only a mode that shards state
/// defines (its optimizer state, gradients or parameters split over the ranks: DDP with
/// `zero(true)`, FullyShardedDataParallel), one table, and the replicated default the loop uses
/// for each member an engine lacks (Single, DataParallel and plain DDP hold everything whole on
/// every rank, so the loop clips by the local norm, steps the whole optimizer and lets rank 0
/// write one archive). The loop calls these functions, never the members directly; the other
/// optional members are in engine/optional_members.hpp.
///
/// | member                                            | the loop calls it / default without it (replicated)   |
/// |---------------------------------------------------|-------------------------------------------------------|
/// | stepped_parameters(module)                        | the tensors the step updates, whose gradients fp16    |
/// |                                                   | unscales. Default: module.parameters() (a sharded     |
/// |                                                   | mode: its pieces, with their reduced chunks)          |
/// | clip_grad_norm(module, max_norm)                  | clipping, on every rank: the norm over every rank's   |
/// |                                                   | gradients (a collective). Default: the local norm     |
/// | step_optimizer(optimizer)                         | the optimizer step, on every rank (not on a step fp16 |
/// |                                                   | skips): this rank's share, then share the result.     |
/// |                                                   | Default: optimizer.step()                             |
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
/// | writes_sharded_checkpoint()                       | true: every rank writes its share (a directory in     |
/// |                                                   | DCP's layout). Default: false, rank 0 writes one      |
/// |                                                   | libtorch archive (checkpoint/checkpoint_file.hpp)     |
/// | checkpoint_shares(module, optimizer)              | this rank's parts of the parameters and optimizer     |
/// |                                                   | state (TensorShare: a key, the tensor's size, a flat  |
/// |                                                   | range). Parameters and buffers no share covers are    |
/// |                                                   | written whole by rank 0                               |
/// | load_optimizer_shares(optimizer, source)          | resuming: reads only this rank's share of the state   |
/// |                                                   | and returns true; false (or absent): the loop loads   |
/// |                                                   | every parameter's whole state                         |
/// | checkpoint_mailbox()                              | the ranks' checkpoint writers tell rank 0's that their|
/// |                                                   | files are written, behind training, without a         |
/// |                                                   | collective (checkpoint/checkpoint_mailbox.hpp: the    |
/// |                                                   | job's store). Default: none — such an engine's        |
/// |                                                   | per-rank checkpoints are written in the foreground    |
/// |                                                   | when it has more than one rank                        |
///
/// DDP's ZeRO-1 defines step_optimizer and the checkpoint members (the latter through
/// RankEngine's distributed/zero/sharded_state.hpp); FullyShardedDataParallel all of them. Per-rank checkpoints are written in
/// torch.distributed.checkpoint's layout (loop/sharded_checkpoint_io.hpp), so nothing is ever
/// gathered whole. Keys are Python's (torch.distributed.checkpoint's flattened state_dict):
/// `model.<name>` for a parameter or buffer (its dotted name, as named_parameters() prints it)
/// and `optim.state.<name>.<field>` for its optimizer state (optim/param_state_fields.hpp names the
/// fields; `step` is a 0-d float64 tensor).

#include <trainloop/checkpoint/checkpoint_mailbox.hpp>
#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <concepts>
#include <optional>
#include <vector>

namespace trainloop::detail {

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

/// Whether `engine` writes per-rank checkpoints now (see the table).
template <class Engine>
bool writes_sharded_checkpoint(Engine& engine) {
  if constexpr (requires { engine.writes_sharded_checkpoint(); }) {
    return engine.writes_sharded_checkpoint();
  } else {
    return false;
  }
}

/// This rank's shares (only called when writes_sharded_checkpoint() is true).
template <class Engine, class Module>
std::vector<TensorShare> checkpoint_shares(Engine& engine, Module& module, torch::optim::Optimizer& optimizer) {
  if constexpr (requires { engine.checkpoint_shares(module, optimizer); }) {
    return engine.checkpoint_shares(module, optimizer);
  } else {
    return {};
  }
}

/// The engine's reading of its share of the optimizer state; false when it has none to read (the
/// loop then loads every parameter's whole state).
template <class Engine>
bool load_optimizer_shares(Engine& engine, torch::optim::Optimizer& optimizer, ShareSource& source) {
  if constexpr (requires { engine.load_optimizer_shares(optimizer, source); }) {
    return engine.load_optimizer_shares(optimizer, source);
  } else {
    return false;
  }
}

/// The messages between the ranks' checkpoint writers (see the table); none without the member.
template <class Engine>
CheckpointMailbox checkpoint_mailbox(Engine& engine) {
  if constexpr (requires { { engine.checkpoint_mailbox() } -> std::convertible_to<CheckpointMailbox>; }) {
    return engine.checkpoint_mailbox();
  } else {
    return {};
  }
}

}  // namespace trainloop::detail
