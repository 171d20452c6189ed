#pragma once
/// @file
/// @brief What a TrainState offers callbacks for the model's weights during fit() — the whole
/// weights on demand (gathered from shards and freed again), and this rank's own copy taken and put
/// back (early stopping's best weights) — for every mode, through the engine's parameter members.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// `state`'s services for the weights (whole on demand, this rank's own copy) of `module`, through
/// the engine's parameter members (engine/optional_members.hpp); each first waits for a checkpoint of
/// `checkpoints` still capturing them (its writer reads the weights in place).
template <ModeEngine Engine, class Module, class Checkpoints>
void describe_weights(Engine& engine, TrainState& state, Module& module, Checkpoints& checkpoints) {
  state.gather_whole_weights = [&engine] { unshard_parameters(engine); };
  state.free_whole_weights = [&checkpoints, &engine] {
    checkpoints.await_checkpoint_capture();  // the shares are written back
    reshard_parameters(engine);
  };
  state.copy_own_weights = [&checkpoints, &module, &engine] {
    checkpoints.await_checkpoint_capture();  // fsdp full refreshes its own chunks from whole units
    torch::NoGradGuard no_grad;
    OwnWeights own;
    if (auto shares = parameter_shares(engine)) {
      own.tensors = std::move(*shares);
      own.shares = true;
    } else {
      for (const auto& parameter : module.parameters()) own.tensors.push_back(parameter.detach().clone());
    }
    for (const auto& buffer : module.buffers()) own.tensors.push_back(buffer.detach().clone());
    return own;
  };
  state.restore_own_weights = [&checkpoints, &module, &engine](const OwnWeights& own) {
    checkpoints.await_checkpoint_capture();  // a checkpoint behind training still copying the weights
    torch::NoGradGuard no_grad;
    auto buffers = module.buffers();
    TRAINLOOP_CHECK(own.tensors.size() >= buffers.size(), "the weights put back hold ", own.tensors.size(),
                    " tensors and the model has ", buffers.size(), " buffers; expected a copy of this model");
    const auto first_buffer = own.tensors.end() - static_cast<std::ptrdiff_t>(buffers.size());
    if (own.shares) {
      load_parameter_shares(engine, std::vector<torch::Tensor>(own.tensors.begin(), first_buffer));
    } else {
      auto parameters = module.parameters();
      TRAINLOOP_CHECK(own.tensors.size() == parameters.size() + buffers.size(), "the weights put back hold ",
                      own.tensors.size(), " tensors but the model has ", parameters.size() + buffers.size(),
                      "; expected the same model");
      // Whole weights into shares (a copy made before the fit sharded them): through the whole model.
      const bool sharded = evaluates_in_lockstep(engine);  // the engine keeps shares now
      if (sharded) unshard_parameters(engine);
      for (std::size_t i = 0; i < parameters.size(); ++i) parameters[i].copy_(own.tensors[i]);
      if (sharded) reshard_parameters(engine);
    }
    for (std::size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(*(first_buffer + static_cast<std::ptrdiff_t>(i)));
  };
}

}  // namespace trainloop::detail
