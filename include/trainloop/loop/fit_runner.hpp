#pragma once
/// @file
/// @brief fit() for every gpu_mode: orchestration of a fit() call (resume, callbacks, epochs,
/// validation, the agreed stop) and the loop's checkpoints. It sees the mode only through the
/// engine interface (engine/mode_engine.hpp), so one loop serves one device, replicas and ranks;
/// an epoch is loop/epoch_trainer.hpp, a step engine/optimizer_step.hpp; what one fit() call owns
/// is a FitRun (loop/fit_run.hpp).
/// It continues from the loop's progress (a second fit() goes on with epoch 3, mid-epoch if the
/// last one stopped there; loop/fit_call.hpp), resumes checkpoints exactly, and writes them
/// (loop/checkpoint_io.hpp). What fit() checks first: loop/fit_inputs.hpp.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/checkpoint/loop_checkpoint.hpp>
#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/history.hpp>
#include <trainloop/engine/step_commit.hpp>
#include <trainloop/loop/checkpoint_io.hpp>
#include <trainloop/loop/committed_state_io.hpp>
#include <trainloop/loop/epoch_batch_plan.hpp>
#include <trainloop/loop/epoch_trainer.hpp>
#include <trainloop/loop/evaluation.hpp>
#include <trainloop/loop/fit_call.hpp>
#include <trainloop/loop/fit_inputs.hpp>
#include <trainloop/loop/fit_run.hpp>
#include <trainloop/loop/shard_indices.hpp>
#include <trainloop/loop/weight_services.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/nn/sync_batch_norm.hpp>
#include <trainloop/options.hpp>
#include <trainloop/precision/grad_scaler.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace trainloop::detail {

/// Runs fit(), evaluate(), predict() and checkpoints for one engine. Holds references to what the
/// TrainLoop owns (the progress included) and, while fit() runs, that call's FitRun.
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
        checkpoints_(module, optimizer, options, progress, identity),
        committed_(module, optimizer, options, progress, std::move(identity)) {}

  /// Trains for `length` from where the loop stands, or, with `resume_from`, from a checkpoint
  /// (continuing the fit() call it was written in, or starting a new one of `length` if that
  /// call had finished). Returns the whole History so far.
  template <ModeEngine Engine>
  History fit(Engine& engine, const FitLength& length, const CallbackList& callbacks, const ResumeSpec& resume = {}) {
    check_fit_inputs(engine, options_, train_, callbacks);
    // Where this process is, for the stall watchdog: setup until the first batch, idle after.
    progress::RegisteredThread training_thread(progress::progress_beacon().threads(), "training thread");
    progress::PhaseScope fit_phase(progress::Phase::Setup);
    progress::progress_beacon().restart_step_clock();
    engine.begin_fit(optimizer_);
    // What lives only during this fit (DDP's gradient hooks, the run's state) goes with it, also
    // on an exception.
    struct EndFit {
      Engine& engine;
      std::optional<FitRun>& run;
      CheckpointIO<Module>& checkpoints;
      ~EndFit() {
        checkpoints.cancel_checkpoints();  // one still in flight after an error: uncommitted, its thread ended
        run.reset();
        engine.end_fit();
      }
    } end_fit{engine, run_, checkpoints_};
    // sync_batchnorm: SyncBatchNorm layers reduce their statistics over the ranks during this fit.
    std::optional<nn::detail::SyncBatchNormScope> sync_batchnorm;
    if (options_.sync_batchnorm() && engine.world_size() > 1) {
      sync_batchnorm.emplace([&engine](torch::Tensor& values) {
        torch::Tensor on_device = values.to(engine.device());
        engine.all_reduce_sum(on_device);
        if (!on_device.is_same(values)) values.copy_(on_device);
      });
    }
    const KeyedStates keyed = keyed_callbacks(callbacks);
    start_fit_call(progress_, options_.seed(), resume_checkpoint(engine, resume, keyed), length);
    FitRun& run = begin_run(engine, length, callbacks, keyed);
    progress::progress_beacon().set_global_step(progress_.global_step);
    std::exception_ptr error;
    try {
      notify_callbacks(run, "on_fit_begin", [&](Callback& cb) { cb.on_fit_begin(run.state); });
      train_epochs(engine, run);
      checkpoints_.finish_checkpoints(engine);  // the last one written behind training, committed and reported
      progress_.fit_finished = true;
      run.visible = progress_.visible_history();
      // No whole-model gather here: a callback that reads the weights asks (TrainState::whole_weights),
      // and end_fit() hands the caller the whole model.
      notify_callbacks(run, "on_fit_end", [&](Callback& cb) { cb.on_fit_end(run.state, run.visible); });
      checkpoints_.finish_checkpoints(engine);  // one a callback started in on_fit_end
    } catch (...) {
      error = std::current_exception();
    }
    for (std::size_t i = 0; i < run.active.size(); ++i) {
      const auto& cb = run.active[i];
      progress::PhaseScope phase(cb->main_process_only() ? progress::Phase::MainOnlyCallback : progress::Phase::Callback,
                                 run.active_names[i].c_str(), "on_fit_finally");
      try {
        cb->on_fit_finally(run.state, error);
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
    progress::RegisteredThread training_thread(progress::progress_beacon().threads(), "training thread");
    progress::PhaseScope phase(progress::Phase::Evaluation);
    return evaluate_dataset<Module, Batch>(engine, module_, dataset, criterion_, options_);
  }

  /// The model's outputs for every sample of `dataset`, in dataset order, on every rank.
  template <ModeEngine Engine>
  torch::Tensor predict(Engine& engine, const data::AnyDataset<Batch>& dataset) {
    progress::RegisteredThread training_thread(progress::progress_beacon().threads(), "training thread");
    progress::PhaseScope phase(progress::Phase::Evaluation, "predict");
    return predict_dataset<Module, Batch>(engine, module_, dataset, options_);
  }

  /// Writes a checkpoint of the loop as it stands (see TrainState::save_checkpoint). A
  /// collective: every rank calls it; rank 0 writes.
  template <ModeEngine Engine>
  void save_checkpoint(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path,
                       bool writes) {
    checkpoints_.save(engine, callbacks, path, writes, run_ && run_->epoch_sums ? &*run_->epoch_sums : nullptr);
  }

  /// Writes a checkpoint of the loop from this process alone, every rank's streams and sums from
  /// the engine's last step commit (FitActions::save_committed; without the model and the
  /// optimizer's state: save_committed_loop_state).
  template <ModeEngine Engine>
  void save_committed(Engine& engine, const KeyedStates& callbacks, const std::filesystem::path& path,
                      bool with_model_and_optimizer = true) {
    committed_.save(engine, callbacks, path, with_model_and_optimizer);
  }

  /// Loads a checkpoint into the model, optimizer, progress and callbacks (and this rank's random
  /// stream when `restore_rng`). Every rank reads the file itself. `keeps_model_and_optimizer`:
  /// the file holds neither (ResumeSpec::keeps_model_and_optimizer).
  template <ModeEngine Engine>
  void load_checkpoint(Engine& engine, const std::filesystem::path& path, const KeyedStates& callbacks,
                       bool restore_rng, bool keeps_model_and_optimizer = false) {
    checkpoints_.load(engine, path, callbacks, restore_rng, keeps_model_and_optimizer);
  }

 private:
  /// Makes this call's FitRun: the epoch plan, the callbacks of this process, where the call
  /// ends, fp16's scaler, and the TrainState callbacks see.
  template <ModeEngine Engine>
  FitRun& begin_run(Engine& engine, const FitLength& length, const CallbackList& callbacks, const KeyedStates& keyed) {
    const DataShard shard = engine.data_shard();
    FitRun& run = run_.emplace(shard, full_epoch_plan(engine, shard));  // the plan once per fit
    for (const auto& cb : callbacks) {
      if (!cb->main_process_only() || engine.is_main()) run.active.push_back(cb);
    }
    std::stable_partition(run.active.begin(), run.active.end(), [](const auto& cb) { return !cb->runs_after_others(); });
    for (const auto& cb : run.active) run.active_names.push_back(cb->state_key());
    if (options_.precision() == Precision::fp16) {
      run.scaler.emplace(options_.grad_scaler());
      if (progress_.grad_scaler_state.defined()) run.scaler->load_state(progress_.grad_scaler_state);
    }
    const FitCallBounds bounds =
        fit_call_bounds(progress_, length, run.full_plan.batches(), options_.grad_accumulation_steps());
    run.end_step = bounds.end_step;
    run.end_epoch = bounds.end_epoch;
    run.state.planned_epochs = bounds.planned_epochs;
    run.state.planned_steps = bounds.planned_steps;
    describe_run(engine, run, keyed);
    return run;
  }

  /// The rest of the TrainState: who this process is, where training stands, and the
  /// collectives and checkpoint writing callbacks may call.
  template <ModeEngine Engine>
  void describe_run(Engine& engine, FitRun& run, const KeyedStates& keyed) {
    TrainState& state = run.state;
    state.world_size = engine.world_size();
    state.rank = engine.rank();
    state.is_main = engine.is_main();
    state.model = &module_;
    state.optimizer = &optimizer_;
    state.num_classes = train_.num_classes().value_or(0);
    state.batches_per_epoch = run.full_plan.batches();
    state.first_epoch = progress_.fit_first_epoch;
    state.epoch = progress_.epochs_completed + 1;  // the epoch about to run (on_fit_begin sees it)
    state.step = progress_.global_step - progress_.fit_first_step;
    state.global_step = progress_.global_step;
    run.visible = progress_.visible_history();
    state.history = &run.visible;
    state.any_rank = [&engine](bool flag) { return engine.any_rank(flag); };
    state.mean_over_ranks = [&engine](double value) {
      if (engine.world_size() == 1) return value;
      torch::Tensor sum = torch::full({1}, value, torch::TensorOptions().dtype(torch::kFloat64).device(engine.device()));
      engine.all_reduce_sum(sum);
      return sum.item<double>() / static_cast<double>(engine.world_size());
    };
    state.save_checkpoint = [this, &engine, keyed](const std::filesystem::path& path) {
      save_checkpoint(engine, keyed, path, engine.is_main());
    };
    state.start_checkpoint = [this, &engine, keyed](const std::filesystem::path& path,
                                                    std::function<void(const CheckpointReport&)> done) {
      checkpoints_.start(engine, keyed, path, engine.is_main(), run_ && run_->epoch_sums ? &*run_->epoch_sums : nullptr,
                         std::move(done));
    };
    state.wait_for_checkpoints = [this, &engine] { checkpoints_.make_room_for_checkpoint(engine); };
    run.await_checkpoint_capture = [this] { checkpoints_.await_checkpoint_capture(); };
    run.poll_checkpoints = [this, &engine] { checkpoints_.poll_checkpoints(engine); };
    run.at_window_start = [this, &engine, keyed](bool epoch_start) {
      committed_.keep_share_copies(engine, keyed);
      // Inside an epoch only: an epoch's validation and on_epoch_end run once, before it.
      if (!epoch_start) admit_agreed_replacements(engine, [&] { checkpoints_.finish_checkpoints(engine); });
    };
    describe_weights(engine, state, module_, checkpoints_);
  }

  /// The epochs of this call, until its length, a stop inside an epoch, or an agreed stop.
  template <ModeEngine Engine>
  void train_epochs(Engine& engine, FitRun& run) {
    EpochTrainer<Module, Batch> epochs(module_, train_, optimizer_, criterion_, options_, progress_);
    TrainState& state = run.state;
    run.clock = Stopwatch();
    bool stopped = false;
    while (!stopped && progress_.epochs_completed < run.end_epoch && progress_.global_step < run.end_step) {
      state.epoch = progress_.epochs_completed + 1;
      state.stop_requested = false;
      notify_callbacks(run, "on_epoch_begin", [&](Callback& cb) { cb.on_epoch_begin(state); });
      // Steps are timed within an epoch: the first one's time would include the last epoch's
      // validation, checkpoint and callbacks, and inflate the stall limit (progress_beacon.hpp).
      progress::progress_beacon().restart_step_clock();
      const bool epoch_done = with_error_context([&] { return epochs.run(engine, run); }, [&] {
        return concat("trainloop: while training epoch ", state.epoch, ", after batch ", state.batch, " of ",
                      state.batches_per_epoch, " (rank ", engine.rank(), ")");
      });
      if (!epoch_done) break;  // stopped inside the epoch: a step limit or an agreed stop request
      stopped = close_epoch(engine, run);
    }
  }

  /// After a complete epoch: validation, on_epoch_end, the finite-loss check, the agreed stop.
  /// Returns true when the ranks agreed to stop.
  template <ModeEngine Engine>
  bool close_epoch(Engine& engine, FitRun& run) {
    TrainState& state = run.state;
    EpochRecord& record = progress_.history.epochs.back();
    if (validation_.has_value()) {
      {
        progress::PhaseScope phase(progress::Phase::Evaluation, "validation");
        record.validation = evaluate_dataset<Module, Batch>(engine, module_, validation_, criterion_, options_);
      }
      notify_callbacks(run, "on_validation_end", [&](Callback& cb) { cb.on_validation_end(state, *record.validation); });
    }
    run.visible = progress_.visible_history();
    // No whole-model gather: a callback that reads the weights asks (TrainState::whole_weights).
    notify_callbacks(run, "on_epoch_end", [&](Callback& cb) { cb.on_epoch_end(state, progress_.history.epochs.back()); });
    TRAINLOOP_CHECK(!options_.stop_on_non_finite_loss() || std::isfinite(record.train_loss),
                    "the training loss of epoch ", record.epoch, " is ", record.train_loss,
                    "; expected a finite number (lower the learning rate, or turn off stop_on_non_finite_loss)");
    const bool stopped = engine.any_rank(state.stop_requested);
    if (stopped) progress_.history.stop_reason = agreed_stop_reason(state);
    return stopped;
  }

  /// Loads the first readable checkpoint of `resume`; false when there was none to load.
  /// @throws trainloop::CheckpointError when none is readable (or the one asked for is not).
  template <ModeEngine Engine>
  bool resume_checkpoint(Engine& engine, const ResumeSpec& resume, const KeyedStates& keyed) {
    return resume_first_readable(
        resume, engine.is_main(),
        [&](const std::filesystem::path& path) {
          load_checkpoint(engine, path, keyed, /*restore_rng=*/true, resume.keeps_model_and_optimizer);
        },
        [&engine](bool flag) { return engine.any_rank(flag); });
  }

  /// The plan of a whole epoch (its micro-batches, on every process).
  template <class Engine>
  EpochBatchPlan full_epoch_plan(const Engine& engine, const DataShard& shard) const {
    EpochBatchPlan plan =
        plan_epoch(train_.size(), shard, options_, exact_uneven_batches(engine, options_), progress_.sampler_seed);
    const int64_t batches = plan.batches();
    const int64_t batch = options_.batch_size();
    TRAINLOOP_CHECK(batches > 0, "an epoch would have no batch: ", train_.size(), " training samples over ",
                    shard.world_size, " process(es) with batch size ", batch, " and drop_last; expected at least ",
                    batch, " samples per process");
    return plan;
  }

  Module& module_;
  const data::AnyDataset<Batch>& train_;
  const data::AnyDataset<Batch>& validation_;
  torch::optim::Optimizer& optimizer_;
  Criterion& criterion_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
  CheckpointIO<Module> checkpoints_;
  CommittedStateIO<Module> committed_;  // elastic training's checkpoints of the committed step
  std::optional<FitRun> run_;  // the state of the fit() call running, while it runs
};

}  // namespace trainloop::detail
