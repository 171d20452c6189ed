#pragma once
/// @file
/// @brief The optional members through which a sharded mode's engine writes and reads its own
/// share of a per-rank checkpoint (torch.distributed.checkpoint's layout: loop/sharded_checkpoint_io.hpp),
/// so nothing is ever gathered whole.
///
/// | member                                         | the loop calls it / default without it               |
/// |------------------------------------------------|------------------------------------------------------|
/// | writes_sharded_checkpoint()                    | true: every rank writes its share (a directory in    |
/// |                                                | DCP's layout). Default: false, rank 0 writes one     |
/// |                                                | libtorch archive (checkpoint/checkpoint_file.hpp)    |
/// | checkpoint_shares(module, optimizer)           | this rank's parts of the parameters and optimizer    |
/// |                                                | state (TensorShare: a key, the tensor's size, a flat |
/// |                                                | range). Parameters and buffers no share covers are   |
/// |                                                | written whole by rank 0                              |
/// | load_optimizer_shares(optimizer, source)       | resuming: reads only this rank's share of the state  |
/// |                                                | and returns true; false (or absent): the loop loads  |
/// |                                                | every parameter's whole state                        |
///
/// Keys are Python's (torch.distributed.checkpoint's flattened state_dict):
/// `model.<name>` for a parameter or buffer (its dotted name, as named_parameters() prints it)
/// and `optim.state.<name>.<field>` for its optimizer state (optim/param_state_fields.hpp names the
/// fields; `step` is a 0-d float64 tensor).

#include <trainloop/checkpoint/checkpoint_shares.hpp>

#include <torch/torch.h>

#include <vector>

namespace trainloop {

namespace detail {

/// Whether `engine` writes per-rank checkpoints now (see the file comment).
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

}  // namespace detail
}  // namespace trainloop
