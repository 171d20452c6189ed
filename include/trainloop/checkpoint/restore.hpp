#pragma once
/// @file
/// @brief Loading a checkpoint into a loop all or nothing: a checkpoint that does not fit (another
/// model, another optimizer, a callback that refuses its state) leaves the model, the optimizer,
/// the progress, the random streams and the callbacks exactly as they were.
///
/// How: everything that can be checked is checked before anything changes (every parameter's and
/// buffer's name, shape and dtype; the optimizer's groups and per-parameter state shapes; the
/// progress; the random streams). What can only be found out by applying it (libtorch's optimizer
/// load, a user's Callback::load_state) is applied to the optimizer and callbacks first, with
/// their previous state kept in memory and put back on a failure. The model is copied last,
/// when nothing can fail any more, so it needs no second copy of its weights.

#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/checkpoint/checkpoint_reader.hpp>
#include <trainloop/checkpoint/rng_state.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/checkpoint/training_progress.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// The optimizer's and the callbacks' state (and this process's random streams) as they were,
/// put back by restore() unless commit() was called first. `options_only`: the restore changes the
/// optimizer's param-group options alone, so only those are kept (not a copy of its whole state).
class StateUndo {
 public:
  StateUndo(torch::optim::Optimizer& optimizer, const KeyedStates& callbacks, bool options_only = false)
      : optimizer_(optimizer), rng_(capture_rng_state()), options_only_(options_only) {
    torch::serialize::OutputArchive archive;
    if (options_only) {
      save_optimizer_groups(optimizer, archive);
    } else {
      save_optimizer_state(optimizer, archive);
    }
    archive.save_to(optimizer_bytes_);
    for (const auto& [key, callback] : callbacks) {
      torch::serialize::OutputArchive one;
      callback->save_state(one);
      std::ostringstream bytes;
      one.save_to(bytes);
      callbacks_.emplace_back(callback, bytes.str());
    }
  }
  StateUndo(const StateUndo&) = delete;
  StateUndo& operator=(const StateUndo&) = delete;
  ~StateUndo() {
    if (!committed_) restore();
  }

  /// Keeps the new state.
  void commit() { committed_ = true; }

 private:
  /// Best effort: each part is put back even if another cannot be.
  void restore() noexcept {
    try {
      std::istringstream bytes(optimizer_bytes_.str());
      torch::serialize::InputArchive archive;
      archive.load_from(bytes);
      if (options_only_) {
        load_optimizer_options(optimizer_, archive);
      } else {
        load_optimizer_state(optimizer_, archive);
      }
    } catch (...) {
    }
    for (auto& [callback, saved] : callbacks_) {
      try {
        std::istringstream bytes(saved);
        torch::serialize::InputArchive archive;
        archive.load_from(bytes);
        callback->load_state(archive);
      } catch (...) {
      }
    }
    try {
      restore_rng_state(rng_);
    } catch (...) {
    }
  }

  torch::optim::Optimizer& optimizer_;
  std::ostringstream optimizer_bytes_;
  std::vector<std::pair<Stateful*, std::string>> callbacks_;
  torch::Tensor rng_;
  bool options_only_ = false;
  bool committed_ = false;
};

/// What restore_checkpoint_with() needs of a checkpoint's format for the model and the optimizer;
/// the progress, the callbacks' states and the random streams are always `file`'s.
struct RestoreSteps {
  std::function<void()> check_model;      ///< throws when the model does not fit; changes nothing
  std::function<void()> check_optimizer;  ///< the same for the optimizer
  std::function<void()> load_optimizer;   ///< may still throw (it is undone then)
  std::function<void()> load_model;       ///< last, when everything else is applied
  /// load_optimizer changes the param groups' options only (the state is kept in memory): the
  /// undo keeps those, not a copy of the whole state.
  bool optimizer_options_only = false;
};

/// The order of a restore that is all or nothing (the file comment): `steps` check, then apply.
/// With a format whose model load reads the data only then (a per-rank checkpoint reads tensor by
/// tensor, checkpoint/dcp_checkpoint.hpp), a read failing in load_model (the disk) leaves the
/// model partly loaded; everything else is put back.
inline TrainingProgress restore_checkpoint_with(CheckpointFile& file, torch::optim::Optimizer& optimizer,
                                                const KeyedStates& callbacks, std::optional<int64_t> rng_rank,
                                                const RestoreSteps& steps) {
  // 1. Read and check, changing nothing.
  steps.check_model();
  TrainingProgress progress = file.progress();
  steps.check_optimizer();
  std::optional<torch::Tensor> rng;
  if (rng_rank) {
    rng = file.rng_state(*rng_rank);
    if (rng) {
      try {
        unpack_rng_state(*rng);
      } catch (const ConfigurationError&) {
        std::throw_with_nested(CheckpointError(concat("trainloop: checkpoint ", file.path().string(), " holds a random ",
                                                      "number generator state for rank ", *rng_rank, " that cannot be "
                                                      "restored; expected a complete trainloop checkpoint")));
      }
    }
  }
  // 2. Apply what may still refuse, with the way back kept.
  StateUndo undo(optimizer, callbacks, steps.optimizer_options_only);
  steps.load_optimizer();
  try {
    file.load_states(callbacks);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& error) {
    std::throw_with_nested(CheckpointError(concat("trainloop: a callback could not load its state from checkpoint ",
                                                  file.path().string(), ": ", error.what(),
                                                  "; expected a checkpoint written with the same callbacks")));
  }
  if (rng) restore_rng_state(*rng);
  // 3. The model last: every tensor was checked, so the copies cannot fail on a shape or dtype.
  steps.load_model();
  undo.commit();
  return progress;
}

/// Loads `file` into `module`, `optimizer` and `callbacks`, and, when `rng_rank` is given, that
/// rank's random streams into this process; returns the progress the checkpoint recorded. All or
/// nothing (see the file comment). `load_optimizer`, when given, is the engine's loader of the
/// optimizer archive (engine/optional_members.hpp): a state in libtorch's layout is checked first as
/// always, one in the engine's own layout is the loader's to check; a failure puts everything back.
/// @throws trainloop::CheckpointError naming the file and what does not fit; nothing changed then.
inline TrainingProgress restore_checkpoint(
    CheckpointFile& file, torch::nn::Module& module, torch::optim::Optimizer& optimizer, const KeyedStates& callbacks,
    std::optional<int64_t> rng_rank,
    const std::function<void(torch::optim::Optimizer&, torch::serialize::InputArchive&)>& load_optimizer = {}) {
  std::vector<CheckpointFile::TensorCopy> model_copies;
  RestoreSteps steps;
  steps.check_model = [&] { model_copies = file.checked_model_tensors(module); };
  steps.check_optimizer = [&] { file.check_optimizer(optimizer, /*engine_loads_own_layout=*/static_cast<bool>(load_optimizer)); };
  steps.load_optimizer = [&] { file.load_optimizer(optimizer, load_optimizer); };
  steps.load_model = [&] { CheckpointFile::copy_model_tensors(model_copies); };
  return restore_checkpoint_with(file, optimizer, callbacks, rng_rank, steps);
}

}  // namespace trainloop::detail
