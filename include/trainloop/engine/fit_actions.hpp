#pragma once
/// @file
/// @brief What a mode that wraps fit() (DDP's launcher and spawned ranks) may do with the loop:
/// train it, write a checkpoint of it, load one into it. TrainLoop::fit() hands these to the
/// mode's run_fit(); the spawn relay moves the loop's whole state between processes with them.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/history.hpp>

#include <filesystem>
#include <functional>

namespace trainloop::detail {

/// The loop's fit(), checkpoint writing and loading, bound to one fit() call's callbacks.
struct FitActions {
  /// Runs the training loop in this process, resuming from the spec's first readable checkpoint.
  std::function<History(const ResumeSpec&)> train;
  /// Writes a checkpoint of the loop (model, optimizer, progress, callbacks, every rank's random
  /// streams). A collective under DDP; the processes for which `writes` is true write it (rank 0
  /// for a checkpoint; every node's local rank 0 when each node's launcher needs a copy).
  std::function<void(const std::filesystem::path&, bool writes)> save;
  /// Loads a checkpoint into the loop (this rank's random stream included); returns the History.
  std::function<History(const std::filesystem::path&)> load;
  /// Writes a checkpoint of the loop from this process alone, with every rank's random stream
  /// and epoch sums from the engine's last step commit (elastic training's hand-off to the
  /// survivors of a lost rank: engine/step_commit.hpp). No collective.
  std::function<void(const std::filesystem::path&)> save_committed;
  /// save_committed's file without the model and the optimizer's state (their param groups' options
  /// kept), for a process that holds them already: resumed with ResumeSpec::keeps_model_and_optimizer.
  /// No collective.
  std::function<void(const std::filesystem::path&)> save_committed_loop_state;
};

}  // namespace trainloop::detail
