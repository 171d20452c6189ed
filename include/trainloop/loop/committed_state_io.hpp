#pragma once
/// @file
/// @brief Elastic training's checkpoints of the step committed last (engine/step_commit.hpp),
/// written by one process without a collective: the hand-off to the survivors of a lost rank and
/// to replacements (distributed/elastic/elastic_fit.hpp), and the copies of sharded state each rank
/// keeps of its own and its neighbour's shares (distributed/elastic/share_copies.hpp). What such a
/// file holds besides the model and the optimizer — the progress, the callbacks, and every rank's
/// random stream and partial epoch sums — comes from the commit, with the world size that made it.
/// The loop's other checkpoints are loop/checkpoint_io.hpp's.

#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/sharded_members.hpp>
#include <trainloop/engine/step_commit.hpp>
#include <trainloop/error.hpp>
#include <trainloop/loop/checkpoint_io.hpp>
#include <trainloop/loop/sharded_checkpoint_io.hpp>
#include <trainloop/nn/memory_format.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/options.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>

#include <concepts>
#include <filesystem>
#include <optional>
#include <utility>

namespace trainloop::detail {

/// Writes checkpoints of the committed step (see the file comment). Holds references to what the
/// TrainLoop owns.
template <class Module>
class CommittedStateIO {
 public:
  /// @param module the model
  /// @param optimizer its optimizer
  /// @param options the loop's options (the batch size and memory format)
  /// @param progress where training stands
  /// @param identity the mode and version stamped into the files
  CommittedStateIO(Module& module, torch::optim::Optimizer& optimizer, const TrainLoopOptions& options,
                   TrainingProgress& progress, RunIdentity identity)
      : module_(module), optimizer_(optimizer), options_(options), progress_(progress), identity_(std::move(identity)) {}

  /// Writes a checkpoint of the loop from this process alone (elastic training's hand-off): the
  /// model and optimizer state this process holds (replicated: every rank's), its progress and
  /// callbacks, and every rank's random stream and partial epoch sums as the engine's last step
  /// commit gathered them — what a checkpoint would have held at that step, with the world size
  /// that committed it. Without `with_model_and_optimizer`, the same less the model and the
  /// optimizer's state (its param groups' options kept), for a process that holds them already
  /// (ResumeSpec::keeps_model_and_optimizer): a few kilobytes whatever the model's size. No collective.
  /// @throws trainloop::Error when the engine committed no step in this fit.
  template <ModeEngine Engine>
  void save(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path, bool with_model_and_optimizer) {
    progress::PhaseScope phase(progress::Phase::CheckpointWrite, path.filename().string());
    const std::optional<CommittedRows> rows = committed_rows(engine);
    TRAINLOOP_CHECK(rows.has_value() && !rows->rng.empty(), "save_committed() with no step committed in this fit; "
                    "expected a step commit (elastic training) first");
    if (!with_model_and_optimizer) {
      write_loop_state(path, callbacks, *rows);
      return;
    }
    torch::serialize::OutputArchive optimizer_state;
    save_optimizer_state(optimizer_, optimizer_state);
    nn::ContiguousScope contiguous(module_, nn::uses_channels_last(options_.memory_format(), module_));
    write_committed(path, module_, optimizer_state, callbacks, *rows);
  }

  /// Elastic training of sharded state: the engine's copies of the state the last step left
  /// (distributed/elastic/share_copies.hpp) — this rank's shares, and on rank 0 what no rank
  /// shards and the loop's state as a per-rank checkpoint's trainloop.pt holds it, with every
  /// rank's streams and sums from the last commit. At the start of each optimizer step once a step
  /// of this fit was committed; a collective. Nothing for an engine that keeps no copies.
  template <ModeEngine Engine>
  void keep_share_copies(Engine& engine, const KeyedStates& callbacks) {
    if constexpr (requires { { engine.keeps_share_copies() } -> std::convertible_to<bool>; }) {
      if (!engine.keeps_share_copies()) return;
      const std::optional<CommittedRows> rows = committed_rows(engine);
      if (!rows.has_value() || rows->rng.empty()) return;  // no commit yet: a loss starts the fit again
      progress::PhaseScope phase(progress::Phase::CheckpointWrite, "elastic share copies");
      UnshardedTensors whole;
      if (engine.rank() == 0) whole = unsharded_tensors(module_, optimizer_);
      engine.keep_share_copies(progress_.global_step, checkpoint_shares(engine, module_, optimizer_), whole.parameters,
                               whole.buffers,
                               [&](const std::filesystem::path& file) { write_loop_state(file, callbacks, *rows); });
    }
  }

 private:
  /// The loop's state of the commit without the model and the optimizer's state: the param groups,
  /// progress, callbacks, streams and sums (a per-rank checkpoint's trainloop.pt holds this).
  void write_loop_state(const std::filesystem::path& path, const KeyedStates& callbacks, const CommittedRows& rows) {
    torch::serialize::OutputArchive groups;
    save_optimizer_groups(optimizer_, groups);
    torch::nn::Module no_model;
    write_committed(path, no_model, groups, callbacks, rows);
  }

  /// A checkpoint of the committed step `rows` came from: `model` and the optimizer part given,
  /// this process's progress and callbacks, every rank's streams and, inside an epoch, sums from
  /// the commit, with the world size that committed it.
  void write_committed(const std::filesystem::path& path, const torch::nn::Module& model,
                       torch::serialize::OutputArchive& optimizer_part, const KeyedStates& callbacks,
                       const CommittedRows& rows) {
    TrainingProgress snapshot = progress_;
    if (progress_.mid_epoch()) snapshot.partial_totals = torch::stack(rows.totals);
    CheckpointHeader header;
    header.trainloop_version = identity_.trainloop_version;
    header.mode = identity_.mode;
    header.world_size = rows.world_size;
    header.batch_size = options_.batch_size();
    write_checkpoint(path, model, optimizer_part, snapshot, callbacks, rows.rng, header);
  }

  Module& module_;
  torch::optim::Optimizer& optimizer_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
  RunIdentity identity_;
};

}  // namespace trainloop::detail
