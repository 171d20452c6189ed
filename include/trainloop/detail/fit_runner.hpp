#pragma once
/// @file
/// @brief The epoch loop shared by every gpu_mode: it sees the mode only through the engine
/// interface (gpu_mode/mode_interface.hpp), so one loop serves one device, replicas and ranks.
/// It continues from the loop's progress (a second fit() goes on with epoch 3, mid-epoch if the
/// last one stopped there), resumes checkpoints exactly, and writes them.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/checkpoint/checkpoint_reader.hpp>
#include <trainloop/checkpoint/restore.hpp>
#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/checkpoint/rng_state.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/evaluation.hpp>
#include <trainloop/detail/metric_accumulator.hpp>
#include <trainloop/detail/shard_indices.hpp>
#include <trainloop/detail/training_progress.hpp>
#include <trainloop/gpu_mode/mode_interface.hpp>
#include <trainloop/history.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/nn/sync_batch_norm.hpp>
#include <trainloop/options.hpp>
#include <trainloop/precision/autocast.hpp>
#include <trainloop/precision/grad_scaler.hpp>
#include <trainloop/schedules/hyperparameters.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <exception>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trainloop::detail {

/// Seconds since a start point.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_;
};

/// What a run is: the mode's name and the version stamped into checkpoints.
struct RunIdentity {
  std::string mode = "single";     ///< "single", "dp" or "ddp"
  std::string trainloop_version;   ///< e.g. "0.2.0"
};

/// Runs fit(), evaluate(), predict() and checkpoints for one engine. Holds references only: the
/// TrainLoop owns everything, the progress included.
template <class Module, class Batch>
class FitRunner {
 public:
  FitRunner(Module& module, const data::AnyDataset<Batch>& train, const data::AnyDataset<Batch>& validation,
            torch::optim::Optimizer& optimizer, Criterion& criterion, const TrainLoopOptions& options,
            TrainingProgress& progress, RunIdentity identity)
      : module_(module),
        train_(train),
        validation_(validation),
        optimizer_(optimizer),
        criterion_(criterion),
        options_(options),
        progress_(progress),
        identity_(std::move(identity)) {}

  /// Trains for `length` from where the loop stands, or, with `resume_from`, from a checkpoint
  /// (continuing the fit() call it was written in, or starting a new one of `length` if that
  /// call had finished). Returns the whole History so far.
  template <ModeEngine Engine>
  History fit(Engine& engine, const FitLength& length, const CallbackList& callbacks, const ResumeSpec& resume = {}) {
    options_.validate();
    TRAINLOOP_CHECK(train_.has_value(), "fit() needs a training dataset");
    TRAINLOOP_CHECK(train_.size() > 0, "the training dataset is empty; expected at least one sample");
    for (const auto& cb : callbacks) TRAINLOOP_CHECK(cb != nullptr, "a null callback was given to fit()");
    TRAINLOOP_CHECK(options_.precision() != Precision::fp16 || engine.device().is_cuda(), "precision is fp16 and the model "
                    "trains on ", engine.device().str(), "; expected a CUDA device for fp16 (use bf16 on the CPU)");
    engine.begin_fit(optimizer_);
    // What lives only during this fit (DDP's gradient hooks) goes with it, also on an exception.
    struct EndFit {
      Engine& engine;
      ~EndFit() { engine.end_fit(); }
    } end_fit{engine};

    // sync_batchnorm: SyncBatchNorm layers reduce their statistics over the ranks during this fit.
    std::optional<nn::detail::SyncBatchNormScope> sync_batchnorm;
    if (options_.sync_batchnorm() && engine.world_size() > 1) {
      sync_batchnorm.emplace([&engine](torch::Tensor& values) {
        torch::Tensor on_device = values.to(engine.device());
        engine.all_reduce_sum(on_device);
        if (!on_device.is_same(values)) values.copy_(on_device);
      });
    }
    const KeyedCallbacks keyed = keyed_callbacks(callbacks);
    const bool resumed = resume_checkpoint(engine, resume, keyed);
    scaler_.reset();
    if (options_.precision() == Precision::fp16) {
      scaler_.emplace(options_.grad_scaler());
      if (progress_.grad_scaler_state.defined()) scaler_->load_state(progress_.grad_scaler_state);
    }
    if (!progress_.seeded) {  // the first fit of this loop; later ones continue the random stream
      torch::manual_seed(options_.seed());
      progress_.sampler_seed = options_.seed();
      progress_.seeded = true;
    }
    if (!resumed || fit_call_finished()) {  // a new fit() call
      progress_.fit_first_epoch = progress_.epochs_completed + 1;
      progress_.fit_first_step = progress_.global_step;
      progress_.fit_finished = false;
    }
    progress_.fit_epoch_count = length.epoch_count();
    progress_.fit_step_count = length.iteration_count();
    progress_.history.stop_reason.clear();

    CallbackList active;
    for (const auto& cb : callbacks) {
      if (!cb->main_process_only() || engine.is_main()) active.push_back(cb);
    }
    std::stable_partition(active.begin(), active.end(), [](const auto& cb) { return !cb->runs_after_others(); });
    const auto shard = engine.data_shard();
    const int64_t batches_per_epoch = full_epoch_batches(shard);
    const int64_t accumulation = options_.grad_accumulation_steps();
    const int64_t steps_per_epoch = (batches_per_epoch + accumulation - 1) / accumulation;
    const int64_t end_step = length.iteration_count() > 0 ? progress_.fit_first_step + length.iteration_count()
                                                          : std::numeric_limits<int64_t>::max();
    // Fitting by iterations, only the step count ends the call; the epoch shown is an estimate.
    const int64_t end_epoch = length.epoch_count() > 0 ? progress_.fit_first_epoch - 1 + length.epoch_count()
                                                       : std::numeric_limits<int64_t>::max();
    const int64_t shown_end_epoch =
        length.epoch_count() > 0
            ? end_epoch
            : progress_.fit_first_epoch - 1 + (length.iteration_count() + steps_per_epoch - 1) / steps_per_epoch;

    TrainState state;
    state.world_size = engine.world_size();
    state.rank = engine.rank();
    state.is_main = engine.is_main();
    state.model = &module_;
    state.optimizer = &optimizer_;
    state.batches_per_epoch = batches_per_epoch;
    state.first_epoch = progress_.fit_first_epoch;
    state.epoch = progress_.epochs_completed + 1;  // the epoch about to run (on_fit_begin sees it)
    state.planned_epochs = shown_end_epoch;
    state.planned_steps = length.iteration_count() > 0 ? length.iteration_count()
                                                       : (end_epoch - progress_.fit_first_epoch + 1) * steps_per_epoch;
    state.step = progress_.global_step - progress_.fit_first_step;
    state.global_step = progress_.global_step;
    History visible = progress_.visible_history();
    state.history = &visible;
    state.any_rank = [&engine](bool flag) { return engine.any_rank(flag); };
    state.mean_over_ranks = [&engine](double value) {
      if (engine.world_size() == 1) return value;
      torch::Tensor sum = torch::full({1}, value, torch::TensorOptions().dtype(torch::kFloat64).device(engine.device()));
      engine.all_reduce_sum(sum);
      return sum.item<double>() / static_cast<double>(engine.world_size());
    };
    state.save_checkpoint = [&](const std::filesystem::path& path) {
      save_checkpoint(engine, keyed, path, engine.is_main());
    };

    Stopwatch fit_clock;
    std::exception_ptr error;
    try {
      for (auto& cb : active) cb->on_fit_begin(state);
      bool stopped = false;
      while (!stopped && progress_.epochs_completed < end_epoch && progress_.global_step < end_step) {
        state.epoch = progress_.epochs_completed + 1;
        state.stop_requested = false;
        for (auto& cb : active) cb->on_epoch_begin(state);
        const bool epoch_done = with_error_context(
            [&] { return train_epoch(engine, shard, state, active, fit_clock, end_step, visible); },
            [&] {
              return concat("trainloop: while training epoch ", state.epoch, ", after batch ", state.batch, " of ",
                            state.batches_per_epoch, " (rank ", engine.rank(), ")");
            });
        if (!epoch_done) break;  // stopped inside the epoch: a step limit or an agreed stop request
        EpochRecord& record = progress_.history.epochs.back();
        if (validation_.has_value()) {
          record.validation = evaluate(engine, validation_);
          for (auto& cb : active) cb->on_validation_end(state, *record.validation);
        }
        visible = progress_.visible_history();
        for (auto& cb : active) cb->on_epoch_end(state, progress_.history.epochs.back());
        TRAINLOOP_CHECK(!options_.stop_on_non_finite_loss() || std::isfinite(record.train_loss),
                        "the training loss of epoch ", record.epoch, " is ", record.train_loss,
                        "; expected a finite number (lower the learning rate, or turn off stop_on_non_finite_loss)");
        stopped = engine.any_rank(state.stop_requested);
        if (stopped) {
          progress_.history.stop_reason =
              state.stop_reason.empty() ? "a callback on another rank asked to stop" : state.stop_reason;
        }
      }
      progress_.fit_finished = true;
      visible = progress_.visible_history();
      for (auto& cb : active) cb->on_fit_end(state, visible);
    } catch (...) {
      error = std::current_exception();
    }
    for (auto& cb : active) {
      try {
        cb->on_fit_finally(state, error);
      } catch (...) {
        if (!error) error = std::current_exception();  // the first error is the one reported
      }
    }
    if (error) std::rethrow_exception(error);
    return progress_.visible_history();
  }

  /// Loss and metrics over `dataset`, this process's shard, reduced over every rank.
  template <ModeEngine Engine>
  EvalResult evaluate(Engine& engine, const data::AnyDataset<Batch>& dataset) {
    return evaluate_dataset<Module, Batch>(engine, module_, dataset, criterion_, options_);
  }

  /// The model's outputs for every sample of `dataset`, in dataset order, on every rank.
  template <ModeEngine Engine>
  torch::Tensor predict(Engine& engine, const data::AnyDataset<Batch>& dataset) {
    return predict_dataset<Module, Batch>(engine, module_, dataset, options_);
  }

  /// Writes a checkpoint of the loop as it stands (see TrainState::save_checkpoint). A
  /// collective: every rank calls it; rank 0 writes.
  template <ModeEngine Engine>
  void save_checkpoint(Engine& engine, const KeyedCallbacks& callbacks, const std::filesystem::path& path,
                       bool writes) {
    // Every rank's random stream and, inside an epoch, its metric sums: gathered to rank 0.
    const std::vector<torch::Tensor> rng = gather_rows(engine, capture_rng_state());
    TrainingProgress snapshot = progress_;
    if (epoch_sums_ != nullptr && progress_.mid_epoch()) {
      snapshot.partial_totals = torch::stack(gather_rows(engine, epoch_sums_->packed_totals().to(torch::kCPU)));
    }
    std::exception_ptr failure;
    if (writes) {
      try {
        CheckpointHeader header;
        header.trainloop_version = identity_.trainloop_version;
        header.mode = identity_.mode;
        header.world_size = engine.world_size();
        header.batch_size = options_.batch_size();
        write_checkpoint(path, module_, optimizer_, snapshot, callbacks, rng, header);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    // Every rank learns whether it worked, so none trains on believing work is saved.
    if (engine.any_rank(failure != nullptr)) {
      if (failure) std::rethrow_exception(failure);  // as itself: a CheckpointError naming the path and the reason
      throw CheckpointError(concat("trainloop: another rank could not write the checkpoint ", path.string(),
                                   " (its error names the cause); training stops so no work is lost unsaved"));
    }
  }

  /// Loads a checkpoint into the model, optimizer, progress and callbacks (and this rank's random
  /// stream when `restore_rng`). Every rank reads the file itself.
  template <ModeEngine Engine>
  void load_checkpoint(Engine& engine, const std::filesystem::path& path, const KeyedCallbacks& callbacks,
                       bool restore_rng) {
    std::optional<torch::Device> device;
    if (auto parameters = module_.parameters(); !parameters.empty()) device = parameters.front().device();
    CheckpointFile file(path, device);
    // All or nothing: a checkpoint that does not fit leaves the loop as it was (checkpoint/restore.hpp).
    progress_ = restore_checkpoint(file, module_, optimizer_, callbacks,
                                   restore_rng ? std::optional<int64_t>(engine.rank()) : std::nullopt);
    // The partial epoch's sums: with the world size that wrote them each rank continues its own;
    // otherwise rank 0 continues their sum (the samples are re-sharded, the totals stay exact).
    if (progress_.partial_totals.defined() && progress_.partial_totals.size(0) != engine.world_size()) {
      progress_.partial_totals = progress_.partial_totals.sum(0, /*keepdim=*/true);
      const int64_t per_step = options_.batch_size() * engine.world_size();
      progress_.batches_into_epoch = static_cast<int64_t>(progress_.samples_into_epoch) / std::max<int64_t>(per_step, 1);
    }
  }

 private:
  /// Loads the first readable checkpoint of `resume`; false when there was none to load.
  /// @throws trainloop::CheckpointError when none is readable (or the one asked for is not).
  template <ModeEngine Engine>
  bool resume_checkpoint(Engine& engine, const ResumeSpec& resume, const KeyedCallbacks& keyed) {
    if (resume.candidates.empty()) {
      if (resume.required && !resume.description.empty()) {
        throw CheckpointError(concat("trainloop: no checkpoint to resume from at ", resume.description));
      }
      if (!resume.description.empty() && engine.is_main()) {
        std::cerr << "trainloop: no checkpoint at " << resume.description << " yet; training from the start\n";
      }
      return false;
    }
    for (size_t i = 0; i < resume.candidates.size(); ++i) {
      try {
        load_checkpoint(engine, resume.candidates[i], keyed, /*restore_rng=*/true);
        if (engine.is_main() && resume.announce) {
          std::cerr << "trainloop: resumed from " << resume.candidates[i].string() << '\n';
        }
        return true;
      } catch (const CheckpointError& error) {
        const bool last_candidate = i + 1 == resume.candidates.size();
        if (!resume.fall_back || last_candidate) throw;
        if (engine.is_main()) {
          std::cerr << error.what() << "\ntrainloop: falling back to the previous checkpoint, "
                    << resume.candidates[i + 1].string() << '\n';
        }
      }
    }
    return false;
  }

  /// Whether the fit() call the progress records ran to its end: it said so, or it reached
  /// the length it was asked for (a checkpoint written in its last epoch's on_epoch_end).
  bool fit_call_finished() const {
    if (progress_.fit_finished) return true;
    if (progress_.fit_epoch_count > 0) {
      return progress_.epochs_completed >= progress_.fit_first_epoch - 1 + progress_.fit_epoch_count;
    }
    return progress_.fit_step_count > 0 && progress_.global_step >= progress_.fit_first_step + progress_.fit_step_count;
  }

  /// Micro-batches of a whole epoch on this process.
  int64_t full_epoch_batches(const DataShard& shard) const {
    const int64_t shard_size =
        static_cast<int64_t>(shard_sampler(train_.size(), shard, true, options_, progress_.sampler_seed).num_samples());
    const int64_t batch = options_.batch_size();
    const int64_t batches = options_.drop_last() ? shard_size / batch : (shard_size + batch - 1) / batch;
    TRAINLOOP_CHECK(batches > 0, "an epoch would have no batch: ", shard_size, " training samples per process with batch size ",
                    batch, " and drop_last; expected at least ", batch, " samples per process");
    return batches;
  }

  /// One row per rank of `local` (same dtype on every rank, any length): lengths gathered first,
  /// rows padded to the longest, gathered, cut back. A collective.
  template <ModeEngine Engine>
  std::vector<torch::Tensor> gather_rows(Engine& engine, const torch::Tensor& local) {
    if (engine.world_size() == 1) return {local.to(torch::kCPU)};
    auto length = torch::full({1}, local.numel(), torch::kInt64);
    const torch::Tensor lengths = engine.all_gather(length).to(torch::kCPU).reshape({-1});
    const int64_t longest = lengths.max().item<int64_t>();
    torch::Tensor padded = torch::zeros({longest}, local.options().device(torch::kCPU));
    padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}).to(torch::kCPU));
    const torch::Tensor all = engine.all_gather(padded).to(torch::kCPU);
    std::vector<torch::Tensor> rows;
    for (int64_t r = 0; r < all.size(0); ++r) rows.push_back(all[r].narrow(0, 0, lengths[r].item<int64_t>()).clone());
    return rows;
  }

  /// Trains (the rest of) one epoch. Returns true when the epoch is complete (its record appended
  /// to the History), false when it stopped inside (step limit, agreed stop): the progress then
  /// holds the position, and the partial record and sums.
  template <ModeEngine Engine>
  bool train_epoch(Engine& engine, const DataShard& shard, TrainState& state, CallbackList& active,
                   const Stopwatch& fit_clock, int64_t end_step, History& visible) {
    Stopwatch epoch_clock;
    const double seconds_before = progress_.seconds_into_epoch;
    module_.train();
    MetricAccumulator sums(options_.metrics(), engine.device());
    if (progress_.partial_totals.defined()) {
      const int64_t rows = progress_.partial_totals.size(0);
      if (rows == engine.world_size()) {
        sums.restore(progress_.partial_totals[engine.rank()]);
      } else if (engine.rank() == 0) {
        sums.restore(progress_.partial_totals[0]);
      }
    }
    epoch_sums_ = &sums;
    struct ForgetSums {
      MetricAccumulator*& sums;
      ~ForgetSums() { sums = nullptr; }
    } forget_sums{epoch_sums_};
    state.running_loss = [&sums] { return sums.running_loss(); };
    // The last micro-batch's loss: its shards' losses weighted by their samples (DataParallel sinks
    // one output per replica), summed lazily so nothing synchronises unless someone asks.
    torch::Tensor last_loss;
    int64_t last_samples = 0;
    bool new_micro_batch = true;
    state.last_loss = [&] { return last_loss.defined() && last_samples > 0 ? last_loss.item<double>() / last_samples : 0.0; };

    train_.set_epoch(static_cast<uint64_t>(state.epoch));  // augmentations drawn for this epoch
    const uint64_t start_position = progress_.samples_into_epoch;
    auto indices = shard_indices(train_.size(), shard, true, options_, state.epoch, progress_.sampler_seed, start_position);
    const int64_t remaining_samples = static_cast<int64_t>(indices.size());
    const int64_t local_before = sums.local_samples();
    data::BatchLoader<data::AnyDataset<Batch>> loader(std::make_shared<data::AnyDataset<Batch>>(train_), std::move(indices),
                                                      static_cast<size_t>(options_.batch_size()),
                                                      static_cast<size_t>(options_.num_workers()), options_.drop_last());
    const int64_t accumulation = options_.grad_accumulation_steps();
    const int64_t batches_done = progress_.batches_into_epoch;
    const int64_t batch = options_.batch_size();
    const int64_t remaining_batches =
        options_.drop_last() ? remaining_samples / batch : (remaining_samples + batch - 1) / batch;
    const int64_t batches = batches_done + remaining_batches;
    state.batches_per_epoch = batches;
    state.batch = batches_done;
    state.epoch_samples = sums.local_samples() * state.world_size;
    bool first_batch = batches_done == 0;
    auto sink = [&](const StepOutput& out) {
      sums.add_loss(out.loss, out.samples);
      if (out.output.defined() && out.target.defined()) sums.add_outputs(out.output, out.target);
      state.epoch_samples += out.samples * state.world_size;
      const auto weighted = out.loss.detach().to(torch::kFloat64) * static_cast<double>(out.samples);
      if (new_micro_batch || !last_loss.defined()) {
        last_loss = weighted;
        last_samples = out.samples;
        new_micro_batch = false;
      } else {
        last_loss = last_loss + weighted.to(last_loss.device());
        last_samples += out.samples;
      }
    };

    bool complete = true;
    int64_t window_start = batches_done;
    // The hyper-parameters of the epoch's last step, for its record (the optimizer's now, if none ran).
    double step_lr = learning_rate_of(optimizer_);
    std::optional<double> step_momentum = momentum_of(optimizer_);
    for (auto&& loaded_batch : loader) {
      const int64_t index = state.batch;
      Batch micro_batch = std::move(loaded_batch);
      if constexpr (is_example_batch_v<Batch>) {
        for (auto& cb : active) cb->on_train_batch(state, micro_batch.data, micro_batch.target);
      }
      const int64_t window = std::min(accumulation, batches - window_start);
      const bool last_in_window = index + 1 == window_start + window;
      auto forward = [this, first_batch, device = engine.device()](Module& replica, const Batch& b) {
        AutocastGuard autocast(options_.precision(), device);  // in the replica's own thread
        return forward_batch(replica, b, criterion_, first_batch);
      };
      const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
      new_micro_batch = true;
      engine.train_micro_batch(micro_batch, forward, loss_scale / static_cast<double>(window), last_in_window, sink);
      first_batch = false;
      state.batch = index + 1;
      state.epoch_seconds = seconds_before + epoch_clock.seconds();
      state.fit_seconds = fit_clock.seconds();
      for (auto& cb : active) cb->on_batch_end(state);
      if (!last_in_window) continue;

      engine.before_optimizer_step();
      // fp16: unscale before clipping; a step with inf/NaN gradients is skipped on every rank.
      const bool overflow = scaler_ && engine.any_rank(scaler_->unscale(module_.parameters()));
      if (options_.clip_grad_norm() > 0.0 && !overflow) {
        torch::nn::utils::clip_grad_norm_(module_.parameters(), options_.clip_grad_norm());
      }
      for (auto& cb : active) cb->on_before_optimizer_step(state);
      step_lr = learning_rate_of(optimizer_);
      step_momentum = momentum_of(optimizer_);
      if (!overflow) optimizer_.step();
      if (scaler_) {
        scaler_->update(overflow);
        progress_.grad_scaler_state = scaler_->state();
        state.skipped_steps = scaler_->skipped_steps();
      }
      engine.after_optimizer_step();
      optimizer_.zero_grad();
      ++state.step;
      state.global_step = ++progress_.global_step;
      ++progress_.steps_into_epoch;
      if (options_.record_steps()) {
        progress_.history.steps.push_back(
            StepRecord{progress_.global_step, state.epoch, step_lr, step_momentum, state.last_loss()});
      }
      window_start = state.batch;
      // Where the epoch stands, for a checkpoint written from on_step_end.
      progress_.batches_into_epoch = state.batch;
      progress_.samples_into_epoch =
          start_position + static_cast<uint64_t>((sums.local_samples() - local_before) * state.world_size);
      progress_.seconds_into_epoch = seconds_before + epoch_clock.seconds();
      for (auto& cb : active) cb->on_step_end(state);
      // Every rank agrees whether to stop after this step (one small collective per step).
      if (engine.any_rank(state.stop_requested)) {
        progress_.history.stop_reason = state.stop_reason.empty() ? "a callback on another rank asked to stop" : state.stop_reason;
        complete = state.batch >= batches;
        break;
      }
      if (progress_.global_step >= end_step) {
        complete = state.batch >= batches;
        break;
      }
    }

    auto totals = sums.packed_totals();
    auto reduced = totals.clone();
    engine.all_reduce_sum(reduced);
    auto values = sums.compute(reduced);
    EpochRecord record;
    record.epoch = state.epoch;
    record.steps = progress_.steps_into_epoch;
    record.samples = values.samples;
    record.train_loss = values.loss;
    record.train_metrics = values.metrics;
    record.seconds = seconds_before + epoch_clock.seconds();
    record.samples_per_second = record.seconds > 0 ? static_cast<double>(record.samples) / record.seconds : 0.0;
    record.learning_rate = step_lr;
    record.momentum = step_momentum;
    state.running_loss = nullptr;
    state.last_loss = nullptr;
    if (complete) {
      progress_.history.epochs.push_back(record);
      progress_.epochs_completed = state.epoch;
      progress_.samples_into_epoch = 0;
      progress_.batches_into_epoch = 0;
      progress_.steps_into_epoch = 0;
      progress_.seconds_into_epoch = 0.0;
      progress_.partial_totals = torch::Tensor();
      progress_.partial_record.reset();
    } else {
      // A later fit() (or a resumed checkpoint) continues this epoch with these sums.
      progress_.partial_totals = torch::stack(gather_rows(engine, totals.to(torch::kCPU)));
      progress_.partial_record = record;
    }
    progress_.history.total_steps = progress_.global_step;
    visible = progress_.visible_history();
    return complete;
  }

  Module& module_;
  const data::AnyDataset<Batch>& train_;
  const data::AnyDataset<Batch>& validation_;
  torch::optim::Optimizer& optimizer_;
  Criterion& criterion_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
  RunIdentity identity_;
  MetricAccumulator* epoch_sums_ = nullptr;  // the current epoch's sums, while it trains
  std::optional<GradScaler> scaler_;         // fp16's loss scaler, during a fit
};

}  // namespace trainloop::detail
