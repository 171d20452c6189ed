#pragma once
/// @file
/// @brief The loop's checkpoints, written and read through the mode's engine (engine/mode_engine.hpp):
/// the whole model (unsharded, contiguous), the optimizer's state as the engine keeps it, the
/// progress, the callbacks' states, and every rank's random stream and partial epoch sums,
/// gathered to rank 0. Rank 0 writes and every rank agrees it did (checkpoint/loop_checkpoint.hpp);
/// every rank reads the file itself, all or nothing (checkpoint/restore.hpp). The file's format is
/// checkpoint/checkpoint_file.hpp's. A sharded engine (engine/sharded_members.hpp) writes a
/// per-rank checkpoint instead, a directory in torch.distributed.checkpoint's layout
/// (loop/sharded_checkpoint_io.hpp), which every mode reads.

#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/checkpoint/checkpoint_names.hpp>
#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/checkpoint/checkpoint_reader.hpp>
#include <trainloop/checkpoint/loop_checkpoint.hpp>
#include <trainloop/checkpoint/module_snapshot.hpp>
#include <trainloop/checkpoint/restore.hpp>
#include <trainloop/checkpoint/rng_state.hpp>
#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/detail/atomic_directory.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/sharded_members.hpp>
#include <trainloop/engine/gather_rows.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/metrics/metric_accumulator.hpp>
#include <trainloop/nn/memory_format.hpp>
#include <trainloop/optim/optimizer_state_bytes.hpp>
#include <trainloop/options.hpp>
#include <trainloop/loop/background_checkpoint_io.hpp>
#include <trainloop/loop/sharded_checkpoint_io.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// A gathered checkpoint (the replicated modes' one file) of a model and optimizer state this size
/// or more is written behind training; a smaller one now. The example's 5 MB checkpoint takes
/// 6.5 ms to write (detail/atomic_file.hpp): below 16 MiB, a thread and one small agreement per step
/// until it commits would not pay. The ~100 M-parameter MLP's 1.2 GB: benchmarks/README.md
/// ("checkpoint_stall", --level none).
inline constexpr int64_t kGatheredBackgroundBytes = int64_t{16} << 20;

/// What a run is: the mode's name and the version stamped into checkpoints.
struct RunIdentity {
  std::string mode = "single";     ///< "single", "dp" or "ddp"
  std::string trainloop_version;   ///< e.g. "0.2.0"
};

/// Writes the loop as it stands into a checkpoint, and loads one into it (see the file comment).
/// Holds references to what the TrainLoop owns.
template <class Module>
class CheckpointIO {
 public:
  /// @param module the model
  /// @param optimizer its optimizer
  /// @param options the loop's options (the batch size and memory format)
  /// @param progress where training stands, saved and restored
  /// @param identity the mode and version stamped into the file
  CheckpointIO(Module& module, torch::optim::Optimizer& optimizer, const TrainLoopOptions& options,
               TrainingProgress& progress, RunIdentity identity)
      : module_(module), optimizer_(optimizer), options_(options), progress_(progress), identity_(std::move(identity)) {}

  /// Writes a checkpoint of the loop as it stands (see TrainState::save_checkpoint). A
  /// collective: every rank calls it; rank 0 writes (`writes`).
  /// @param engine the mode's engine
  /// @param callbacks the callbacks' states, by key
  /// @param path the file
  /// @param writes whether this rank writes the file
  /// @param epoch_sums the current epoch's metric sums while fit() trains one, or null
  template <ModeEngine Engine>
  void save(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path, bool writes,
            const MetricAccumulator* epoch_sums) {
    progress::PhaseScope phase(progress::Phase::CheckpointWrite, path.filename().string());
    background_.drain(engine);  // one in flight ends first: checkpoints commit in order
    const Moment moment = this_moment(engine, epoch_sums);
    if (writes_per_rank(engine, writes)) {
      save_sharded_checkpoint(engine, module_, optimizer_, path, loop_state_writer(callbacks, moment));
      return;
    }
    save_gathered(engine, callbacks, path, writes, moment);
  }

  /// Starts a checkpoint of the loop as it stands (TrainState::start_checkpoint): a per-rank one
  /// is written behind training (loop/background_checkpoint_io.hpp), and so is a gathered one of
  /// kGatheredBackgroundBytes or more (replicated modes: rank 0's file); any other now. A collective.
  template <ModeEngine Engine>
  void start(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path, bool writes,
             const MetricAccumulator* epoch_sums, std::function<void(const CheckpointReport&)> done) {
    progress::PhaseScope phase(progress::Phase::CheckpointWrite, path.filename().string());
    Stopwatch clock;
    background_.make_room(engine);  // its report first; checkpoints commit in order
    const Moment moment = this_moment(engine, epoch_sums);
    const bool per_rank = writes_per_rank(engine, writes);
    const bool per_rank_behind = per_rank && (engine.world_size() == 1 || checkpoint_mailbox(engine));
    if (per_rank_behind || (!per_rank && gathered_behind_training(engine, path, writes))) {
      try {
        if (per_rank_behind) {
          background_.start(engine, module_, optimizer_, path, progress_.global_step, loop_state_writer(callbacks, moment),
                            done);
        } else {
          start_gathered(engine, callbacks, path, writes, moment, done);
        }
      } catch (const Error&) {  // agreed: every rank could not start it (stop_on_error decides)
        done(CheckpointReport{path, std::current_exception(), true, clock.seconds(), clock.seconds()});
      }
      return;
    }
    CheckpointReport report{path, nullptr, false, 0.0, 0.0};
    try {
      if (per_rank) {
        save_sharded_checkpoint(engine, module_, optimizer_, path, loop_state_writer(callbacks, moment));
      } else {
        save_gathered(engine, callbacks, path, writes, moment);
      }
    } catch (const Error&) {
      report.error = std::current_exception();  // every rank has one (the writes are agreed)
    }
    report.blocked_seconds = report.seconds = clock.seconds();
    done(report);
  }

  /// Before another checkpoint: waits for the one written behind training and reports it (back
  /// pressure, said once). A collective while one is in flight; nothing otherwise.
  template <ModeEngine Engine>
  void make_room_for_checkpoint(Engine& engine) { background_.make_room(engine); }
  /// Before the parameters or the optimizer state change in place: waits for the copy of a
  /// checkpoint being written behind training. No collective.
  void await_checkpoint_capture() { background_.await_capture(); }
  /// At a step boundary, on every rank: reports a checkpoint written behind training once every
  /// rank agrees it ended (a small collective while one is in flight).
  template <ModeEngine Engine>
  void poll_checkpoints(Engine& engine) { background_.poll(engine); }
  /// Waits for a checkpoint written behind training and reports it (end of fit(): a collective).
  template <ModeEngine Engine>
  void finish_checkpoints(Engine& engine) { background_.drain(engine); }
  /// Drops a checkpoint being written behind training, uncommitted (fit() failed). No collective.
  void cancel_checkpoints() { background_.cancel(); }

 private:
  /// What a checkpoint holds besides the model and optimizer: every rank's random stream and,
  /// inside an epoch, its metric sums (gathered to rank 0: a collective), the progress, the header.
  struct Moment {
    std::vector<torch::Tensor> rng;
    TrainingProgress progress;
    CheckpointHeader header;
  };
  template <ModeEngine Engine>
  Moment this_moment(Engine& engine, const MetricAccumulator* epoch_sums) {
    Moment moment;
    moment.rng = gather_rows(engine, capture_rng_state());
    progress::test_kill_point(progress::KillPoint::Checkpoint);  // its peers are inside this checkpoint's collectives
    moment.progress = progress_;
    if (epoch_sums != nullptr && progress_.mid_epoch()) {
      moment.progress.partial_totals = torch::stack(gather_rows(engine, epoch_sums->packed_totals().to(torch::kCPU)));
    }
    moment.header.trainloop_version = identity_.trainloop_version;
    moment.header.mode = identity_.mode;
    moment.header.world_size = engine.world_size();
    moment.header.batch_size = options_.batch_size();
    return moment;
  }
  /// Every rank its share, nothing gathered (a collective) — unless writers on other ranks than 0
  /// each want a copy of their own (the spawned ranks' handoff on several machines, each machine's
  /// local rank 0 writing into its launcher's directory): that copy is written gathered.
  template <ModeEngine Engine>
  bool writes_per_rank(Engine& engine, bool writes) {
    const bool other_writers = engine.world_size() > 1 && engine.any_rank(writes && engine.rank() != 0);
    return writes_sharded_checkpoint(engine) && !other_writers;
  }
  /// trainloop.pt of a per-rank checkpoint (rank 0): the model is in the ranks' files.
  std::function<void(const std::filesystem::path&)> loop_state_writer(const KeyedStates& callbacks, const Moment& moment) {
    return [this, &callbacks, &moment](const std::filesystem::path& state_file) {
      torch::serialize::OutputArchive groups;
      save_optimizer_groups(optimizer_, groups);
      torch::nn::Module no_model;
      write_checkpoint(state_file, no_model, groups, moment.progress, callbacks, moment.rng, moment.header);
    };
  }
  /// The whole model and optimizer state in one file rank 0 writes (a collective for a sharded
  /// mode: its ranks' shards are gathered).
  template <ModeEngine Engine>
  void save_gathered(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path, bool writes,
                     const Moment& moment) {
    const TrainingProgress& snapshot = moment.progress;
    const std::vector<torch::Tensor>& rng = moment.rng;
    const CheckpointHeader& header = moment.header;
    // A collective for a sharded mode (its ranks' shards); otherwise only the writer serializes.
    unshard_parameters(engine);  // the model written whole
    torch::serialize::OutputArchive optimizer_state;
    save_engine_optimizer_state(engine, optimizer_, optimizer_state, writes);
    write_checkpoint_agreed(path, writes, [&engine](bool flag) { return engine.any_rank(flag); },
                            [&] {
                              // Written contiguous: any program loads the weights with torch::load.
                              nn::ContiguousScope contiguous(module_, nn::uses_channels_last(options_.memory_format(), module_));
                              // The same name written as a per-rank checkpoint before (a run resumed
                              // in another mode): the file takes the directory's place whole.
                              if (is_sharded_checkpoint(path)) {
                                const std::filesystem::path temporary = make_temporary_directory_for(path);
                                write_checkpoint(temporary / "checkpoint", module_, optimizer_state, snapshot, callbacks, rng, header);
                                replace_with_file(temporary, temporary / "checkpoint", path);
                                return;
                              }
                              write_checkpoint(path, module_, optimizer_state, snapshot, callbacks, rng, header);
                            });
  }

  /// Whether a gathered checkpoint goes behind training (the same answer on every rank): the whole
  /// state holds kGatheredBackgroundBytes or more, rank 0 alone writes, and the file needs nothing
  /// done to the model first (channels-last weights are written contiguous; a per-rank checkpoint of
  /// the same name is replaced by the file) — those are written now.
  template <ModeEngine Engine>
  bool gathered_behind_training(Engine& engine, const std::filesystem::path& path, bool writes) {
    const int64_t model = model_bytes();
    if (model < kGatheredBackgroundBytes && model + optimizer_state_bytes(optimizer_) < kGatheredBackgroundBytes) return false;
    if (nn::uses_channels_last(options_.memory_format(), module_)) return false;
    const bool here_not = writes && (engine.rank() != 0 || is_sharded_checkpoint(path));
    return !(engine.world_size() > 1 ? engine.any_rank(here_not) : here_not);
  }
  /// Bytes of the model's parameters and buffers on this rank.
  int64_t model_bytes() const {
    int64_t bytes = 0;
    for (const auto& tensor : module_.parameters()) bytes += static_cast<int64_t>(tensor.nbytes());
    for (const auto& tensor : module_.buffers()) bytes += tensor.defined() ? static_cast<int64_t>(tensor.nbytes()) : 0;
    return bytes;
  }
  /// The gathered checkpoint of `moment` started behind training: the optimizer's state as the
  /// engine saves it (a collective for a sharded engine), then rank 0's archive, with host buffers
  /// standing in for the parameters and the optimizer's state and the model's buffers copied
  /// (checkpoint/gathered_capture.hpp, module_snapshot.hpp), for its thread to fill and stream.
  template <ModeEngine Engine>
  void start_gathered(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path, bool writes,
                      const Moment& moment, std::function<void(const CheckpointReport&)> done) {
    unshard_parameters(engine);
    GatheredCapture& capture = background_.gathered_capture();  // free: start() made room first
    capture.begin();
    torch::serialize::OutputArchive optimizer_state;
    {
      std::optional<OptimizerStandIns> stand_ins;
      if (writes) stand_ins.emplace(optimizer_, capture);
      save_engine_optimizer_state(engine, optimizer_, optimizer_state, writes);
    }
    background_.start_gathered(
        engine,
        [&] {
          return checkpoint_archive(
              module_, [&](torch::serialize::OutputArchive& into) { save_module_snapshot(module_, into, capture); },
              optimizer_state, moment.progress, callbacks, moment.rng, moment.header, path);
        },
        path, progress_.global_step, writes, std::move(done));
  }

 public:
  /// Loads a checkpoint into the model, optimizer, progress and callbacks (and this rank's random
  /// stream when `restore_rng`). Every rank reads the file itself.
  /// @param engine the mode's engine
  /// @param path the file
  /// @param callbacks the callbacks' states, by key
  /// @param restore_rng whether this rank's random stream is restored too
  /// @param keeps_model_and_optimizer the file holds neither: the model and the optimizer's state
  ///        stay as they are, its param groups' options are read (ResumeSpec::keeps_model_and_optimizer)
  template <ModeEngine Engine>
  void load(Engine& engine, const std::filesystem::path& path, const KeyedStates& callbacks, bool restore_rng,
            bool keeps_model_and_optimizer = false) {
    progress::PhaseScope phase(progress::Phase::CheckpointRead, path.filename().string());
    std::optional<torch::Device> device;
    if (auto parameters = module_.parameters(); !parameters.empty()) device = parameters.front().device();
    const std::optional<int64_t> rng_rank = restore_rng ? std::optional<int64_t>(engine.rank()) : std::nullopt;
    if (keeps_model_and_optimizer) {
      CheckpointFile file(path, device);
      RestoreSteps steps;
      steps.check_model = [] {};
      steps.check_optimizer = [&] { file.check_optimizer(optimizer_); };
      steps.load_optimizer = [&] { file.load_optimizer(optimizer_, load_optimizer_options); };
      steps.load_model = [] {};
      steps.optimizer_options_only = true;
      progress_ = restore_checkpoint_with(file, optimizer_, callbacks, rng_rank, steps);
    } else if (is_sharded_checkpoint(path)) {
      progress_ = load_sharded(engine, path, device, callbacks, rng_rank);
    } else {
      CheckpointFile file(path, device);
      // All or nothing: a checkpoint that does not fit leaves the loop as it was (checkpoint/restore.hpp).
      progress_ = restore_checkpoint(file, module_, optimizer_, callbacks, rng_rank, engine_optimizer_loader(engine));
    }
    // The partial epoch's sums: with the world size that wrote them each rank continues its own;
    // otherwise rank 0 continues their sum (the samples are re-sharded, the totals stay exact).
    if (progress_.partial_totals.defined() && progress_.partial_totals.size(0) != engine.world_size()) {
      progress_.partial_totals = progress_.partial_totals.sum(0, /*keepdim=*/true);
      const int64_t per_step = options_.batch_size() * engine.world_size();
      progress_.batches_into_epoch = static_cast<int64_t>(progress_.samples_into_epoch) / std::max<int64_t>(per_step, 1);
    }
  }

 private:
  /// A per-rank checkpoint (checkpoint/dcp_checkpoint.hpp), written by any mode and world size:
  /// the model read tensor by tensor, the optimizer state as this engine keeps it (a sharded
  /// engine reads only its share), all or nothing as restore_checkpoint().
  template <ModeEngine Engine>
  TrainingProgress load_sharded(Engine& engine, const std::filesystem::path& path, std::optional<torch::Device> device,
                                const KeyedStates& callbacks, std::optional<int64_t> rng_rank) {
    DcpCheckpoint checkpoint(path);
    if (!checkpoint.has_loop_state()) {
      throw CheckpointError(concat("trainloop: ", path.string(), " is a torch.distributed.checkpoint directory without "
                                   "trainloop's state (", kDcpLoopStateFile, "), such as Python's dcp.save writes: "
                                   "weights, no progress to resume; expected a checkpoint written by trainloop (load "
                                   "its weights with interop::load_dcp_weights)"));
    }
    CheckpointFile file(path / kDcpLoopStateFile, device);
    RestoreSteps steps;
    steps.check_model = [&] { checkpoint.check_model(module_); };
    steps.check_optimizer = [&] {
      file.check_optimizer(optimizer_);
      checkpoint.check_optimizer_states(optimizer_, module_);
    };
    steps.load_optimizer = [&] {
      file.load_optimizer(optimizer_);  // the param groups' options; the state is in the ranks' files
      if (!load_optimizer_shares(engine, optimizer_, checkpoint)) checkpoint.load_whole_optimizer_states(optimizer_, module_);
    };
    steps.load_model = [&] { checkpoint.load_model(module_); };
    return restore_checkpoint_with(file, optimizer_, callbacks, rng_rank, steps);
  }

  Module& module_;
  torch::optim::Optimizer& optimizer_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
  RunIdentity identity_;
  BackgroundCheckpoints background_;
};

}  // namespace trainloop::detail
