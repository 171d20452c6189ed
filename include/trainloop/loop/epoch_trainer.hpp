#pragma once
/// @file
/// @brief One epoch of training (or the rest of one): batches from this process's shard, the
/// mode's forward/backward, one optimizer step per accumulation window, step-level callbacks, the
/// epoch's record. The same code for every mode (it sees the engine interface only).
///
/// A pass over an epoch, in the order run() calls them: begin_pass (the sums, the plan of the
/// micro-batches), open_loader, then per micro-batch train_micro_batch and, at the end of each
/// accumulation window, step (the optimizer step, the progress a checkpoint sees, the agreed stop);
/// finish_pass (the epoch's record, or the partial one of an epoch stopped inside).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/gather_rows.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optimizer_step.hpp>
#include <trainloop/engine/step_commit.hpp>
#include <trainloop/history.hpp>
#include <trainloop/loop/batch_memory_format.hpp>
#include <trainloop/loop/epoch_batch_plan.hpp>
#include <trainloop/loop/fit_run.hpp>
#include <trainloop/loop/last_micro_batch_loss.hpp>
#include <trainloop/loop/loader_for.hpp>
#include <trainloop/loop/shard_indices.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/optim/hyperparameters.hpp>
#include <trainloop/optim/optimizer_state_bytes.hpp>
#include <trainloop/options.hpp>
#include <trainloop/precision/autocast.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/straggler_events.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>

namespace trainloop::detail {

/// Where one pass over (the rest of) an epoch stands; made by begin_pass, lives in run().
struct EpochPass {
  explicit EpochPass(EpochBatchPlan micro_batches) : plan(std::move(micro_batches)) {}

  EpochBatchPlan plan;           ///< the micro-batches of this pass (from the resume position on)
  bool exact = false;            ///< exact uneven batches: shards unpadded, ranks weighted by samples
  uint64_t start_position = 0;   ///< samples of the epoch (all ranks) consumed before this pass
  int64_t batches_done = 0;      ///< micro-batches of the epoch before this pass
  int64_t batches = 0;           ///< micro-batches of the whole epoch
  int64_t window_start = 0;      ///< the first micro-batch of the current accumulation window
  double seconds_before = 0.0;   ///< seconds of the epoch before this pass
  // The time this thread waits for the loader: from the end of one batch's work (or the loader's
  // start) until the next batch is in hand. Summed per batch, two clock reads each.
  double data_wait = 0.0;
  bool first_batch = false;      ///< forward_batch checks the labels of an epoch's first batch
  bool channels_last = false;    ///< batches go channels-last with the model
  bool complete = true;          ///< false once the pass stops inside the epoch
  Stopwatch clock;               ///< since the pass began
  LastMicroBatchLoss last_loss;  ///< what TrainState::last_loss reads
  OptimizerStepResult last_step; ///< the hyper-parameters of the last step (the optimizer's own before one ran)
};

/// Trains epochs for a FitRunner. Its references are the TrainLoop's (model, data, optimizer,
/// options, progress); what belongs to one fit() call is in the FitRun passed to run().
template <class Module, class Batch>
class EpochTrainer {
 public:
  EpochTrainer(Module& module, const data::AnyDataset<Batch>& train, torch::optim::Optimizer& optimizer,
               Criterion& criterion, const TrainLoopOptions& options, TrainingProgress& progress)
      : module_(module), train_(train), optimizer_(optimizer), criterion_(criterion), options_(options), progress_(progress) {}

  /// Trains (the rest of) one epoch. Returns true when the epoch is complete (its record appended
  /// to the History), false when it stopped inside (step limit, agreed stop): the progress then
  /// holds the position, and the partial record and sums.
  template <ModeEngine Engine>
  bool run(Engine& engine, FitRun& run) {
    EpochPass pass = begin_pass(engine, run);
    struct EndPass {  // the sums and what reads them live as long as the pass, also on an exception
      FitRun& run;
      ~EndPass() {
        run.state.running_loss = nullptr;
        run.state.last_loss = nullptr;
        run.epoch_sums.reset();
      }
    } end_pass{run};
    run.state.running_loss = [&sums = *run.epoch_sums] { return sums.running_loss(); };
    run.state.last_loss = [&pass] { return pass.last_loss.value(); };
    progress::ProgressBeacon& beacon = progress::progress_beacon();
    beacon.set_phase(progress::Phase::LoadingBatch);
    auto loader = open_loader(engine, run, pass);
    Stopwatch waiting;
    auto next = loader.begin();
    for (int64_t k = 0; k < pass.plan.batches(); ++k) {
      beacon.set_position(run.state.epoch, pass.batches_done + k + 1, pass.batches);
      if (k > 0 && next != loader.end()) {
        beacon.set_phase(progress::Phase::LoadingBatch);
        ++next;
      }
      // None: this rank has no samples in micro-batch k (exact uneven batches, the epoch's last).
      std::optional<Batch> micro_batch;
      if (next != loader.end()) micro_batch.emplace(std::move(*next));
      pass.data_wait += waiting.seconds();
      struct RestartOnExit {  // every way out of the body (continue, break) ends this batch's work
        Stopwatch& clock;
        ~RestartOnExit() { clock = Stopwatch(); }
      } restart_waiting{waiting};
      const bool window_ends = train_micro_batch(engine, run, pass, micro_batch, k);
      if (window_ends && step(engine, run, pass)) break;
    }
    return finish_pass(engine, run, pass);
  }

 private:
  /// The epoch's sums (restored when resuming inside it), the plan of its remaining micro-batches,
  /// and what callbacks see of the epoch's position.
  template <class Engine>
  EpochPass begin_pass(Engine& engine, FitRun& run) {
    TrainState& state = run.state;
    module_.train();
    MetricAccumulator& sums = run.epoch_sums.emplace(options_.metrics(), engine.device());
    if (progress_.partial_totals.defined()) {
      if (progress_.partial_totals.size(0) == engine.world_size()) {
        sums.restore(progress_.partial_totals[engine.rank()]);
      } else if (engine.rank() == 0) {
        sums.restore(progress_.partial_totals[0]);
      }
    }
    train_.set_epoch(static_cast<uint64_t>(state.epoch));  // augmentations drawn for this epoch
    const uint64_t start_position = progress_.samples_into_epoch;
    // Every rank runs plan.batches() micro-batches; with exact uneven batches a rank's last one may
    // be short or empty, and its loss weighs by its samples (loop/epoch_batch_plan.hpp).
    const bool exact = exact_uneven_batches(engine, options_);
    EpochPass pass(start_position == 0
                       ? run.full_plan
                       : plan_epoch(train_.size(), run.shard, options_, exact, progress_.sampler_seed, start_position));
    pass.exact = exact;
    pass.start_position = start_position;
    pass.batches_done = progress_.batches_into_epoch;
    pass.batches = pass.batches_done + pass.plan.batches();
    pass.window_start = pass.batches_done;
    pass.seconds_before = progress_.seconds_into_epoch;
    pass.data_wait = progress_.data_wait_into_epoch;
    pass.first_batch = pass.batches_done == 0;
    pass.channels_last = nn::uses_channels_last(options_.memory_format(), module_);
    pass.last_step = {learning_rate_of(optimizer_), momentum_of(optimizer_), false};
    state.batches_per_epoch = pass.batches;
    state.batch = pass.batches_done;
    state.epoch_samples = sums.local_samples() * state.world_size;
    return pass;
  }

  /// This process's loader over its shard of the epoch, from the pass's start position on.
  template <class Engine>
  auto open_loader(Engine& engine, const FitRun& run, const EpochPass& pass) {
    auto indices = shard_indices(train_.size(), run.shard, true, options_, run.state.epoch, progress_.sampler_seed,
                                 pass.start_position, /*pad_training=*/!pass.exact);
    return loader_for(train_, std::move(indices), options_.batch_size(), options_.drop_last(), options_,
                      engine.device());
  }

  /// Forward and backward of micro-batch `k` (or the reduction without samples), its sums, and
  /// on_batch_end. Returns true when it ends an accumulation window (a step follows).
  template <class Engine>
  bool train_micro_batch(Engine& engine, FitRun& run, EpochPass& pass, std::optional<Batch>& micro_batch, int64_t k) {
    TrainState& state = run.state;
    TRAINLOOP_CHECK(micro_batch.has_value() == (pass.plan.samples(run.shard.rank, k) > 0), "rank ", engine.rank(),
                    (micro_batch ? " has" : " has no"), " batch ", pass.batches_done + k + 1, " of ", pass.batches,
                    "; expected the same micro-batch count on every rank (a dataset whose size changed?)");
    const int64_t index = state.batch;
    // Elastic training: sharded state copied before this step changes it; replacements joining.
    if (index == pass.window_start && run.at_window_start) run.at_window_start(index == 0);
    const int64_t window = std::min(options_.grad_accumulation_steps(), pass.batches - pass.window_start);
    const bool last_in_window = index + 1 == pass.window_start + window;
    pass.last_loss.start();
    if (micro_batch) {
      if constexpr (is_example_batch_v<Batch>) {
        notify_callbacks(run, "on_train_batch",
                         [&](Callback& cb) { cb.on_train_batch(state, micro_batch->data, micro_batch->target); });
      }
      auto forward = [this, first = pass.first_batch, channels_last = pass.channels_last,
                      device = engine.device()](Module& replica, const Batch& b) {
        AutocastGuard autocast(options_.precision(), device);  // in the replica's own thread
        progress::progress_beacon().set_phase(progress::Phase::Forward);
        progress::test_kill_point(progress::KillPoint::Forward);
        StepOutput out = forward_batch(replica, batch_in_memory_format(b, channels_last), criterion_, first);
        progress::progress_beacon().set_phase(progress::Phase::Backward);  // what every engine does next
        return out;
      };
      auto sink = [&run, &pass](const StepOutput& out) {
        run.epoch_sums->add_loss(out.loss, out.samples);
        if (out.output.defined() && out.target.defined()) run.epoch_sums->add_outputs(out.output, out.target);
        run.state.epoch_samples += out.samples * run.state.world_size;
        pass.last_loss.add(out);
      };
      const double loss_scale = run.scaler ? run.scaler->scale() : 1.0;
      const double weight = pass.plan.gradient_weight(run.shard.rank, k);  // 1.0 unless batches are uneven
      engine.train_micro_batch(*micro_batch, forward, loss_scale * weight / static_cast<double>(window),
                               last_in_window, sink);
      pass.first_batch = false;
    } else if constexpr (TrainsWithoutSamples<Engine>) {
      engine.train_without_samples(last_in_window);
    }
    state.batch = index + 1;
    state.epoch_seconds = pass.seconds_before + pass.clock.seconds();
    state.fit_seconds = run.clock.seconds();
    notify_callbacks(run, "on_batch_end", [&](Callback& cb) { cb.on_batch_end(state); });
    return last_in_window;
  }

  /// The optimizer step ending a window, the progress a checkpoint written in on_step_end sees,
  /// and the agreed stop. Returns true when the pass ends here (a stop, or the fit's last step).
  template <class Engine>
  bool step(Engine& engine, FitRun& run, EpochPass& pass) {
    // The last gradients' reduction, the step, on_step_end and the agreed stop.
    progress::PhaseScope phase(progress::Phase::OptimizerStep);
    TrainState& state = run.state;
    const OptimizerStepRequest<Module> request{module_, optimizer_, run.scaler ? &*run.scaler : nullptr,
                                               options_.clip_grad_norm(), [&run] {
                                                 notify_callbacks(run, "on_before_optimizer_step", [&](Callback& cb) {
                                                   cb.on_before_optimizer_step(run.state);
                                                 });
                                               }};
    // Elastic training: the step's commit gathers every rank's sums with the streams (engine/step_commit.hpp).
    if (commits_steps(engine)) stage_step_totals(engine, run.epoch_sums->packed_totals());
    // A checkpoint being written behind training copies the state this step changes: it waits for that.
    if (run.await_checkpoint_capture) run.await_checkpoint_capture();
    pass.last_step = run_optimizer_step(engine, request);
    if (run.scaler) {
      state.skipped_steps = run.scaler->skipped_steps();
      progress_.grad_scaler_state = run.scaler->state();
    }
    ++state.step;
    state.global_step = ++progress_.global_step;
    progress::progress_beacon().step_completed(progress_.global_step);
    ++progress_.steps_into_epoch;
    if (options_.record_steps()) {
      progress_.history.steps.push_back(StepRecord{progress_.global_step, state.epoch, pass.last_step.learning_rate,
                                                   pass.last_step.momentum, state.last_loss()});
    }
    pass.window_start = state.batch;
    progress_.batches_into_epoch = state.batch;
    progress_.samples_into_epoch =
        pass.start_position + static_cast<uint64_t>(pass.plan.combined_samples_before(state.batch - pass.batches_done));
    progress_.seconds_into_epoch = pass.seconds_before + pass.clock.seconds();
    progress_.data_wait_into_epoch = pass.data_wait;
    if (run.poll_checkpoints) run.poll_checkpoints();  // a checkpoint behind training that ended reports first
    for (const StragglerRecord& straggler : progress::straggler_events().take()) {  // rank 0's watchdog named one
      progress_.history.stragglers.push_back(straggler);
      notify_callbacks(run, "on_straggler", [&](Callback& cb) { cb.on_straggler(state, straggler); });
    }
    notify_callbacks(run, "on_step_end", [&](Callback& cb) { cb.on_step_end(state); });
    // Every rank agrees whether to stop after this step (one small collective per step).
    const bool stop = engine.any_rank(state.stop_requested);
    if (stop) progress_.history.stop_reason = agreed_stop_reason(state);
    if (stop || progress_.global_step >= run.end_step) {
      pass.complete = state.batch >= pass.batches;
      return true;
    }
    return false;
  }

  /// The epoch's record from every rank's sums; appended to the History when the epoch is
  /// complete, kept with the sums in the progress when it stopped inside. Returns pass.complete.
  template <class Engine>
  bool finish_pass(Engine& engine, FitRun& run, const EpochPass& pass) {
    const torch::Tensor totals = run.epoch_sums->packed_totals();
    EpochRecord record = epoch_record(engine, run, pass, totals);
    if (pass.complete) {
      progress_.history.epochs.push_back(record);
      progress_.epochs_completed = run.state.epoch;
      progress_.samples_into_epoch = 0;
      progress_.batches_into_epoch = 0;
      progress_.steps_into_epoch = 0;
      progress_.seconds_into_epoch = 0.0;
      progress_.data_wait_into_epoch = 0.0;
      progress_.partial_totals = torch::Tensor();
      progress_.partial_record.reset();
    } else {
      // A later fit() (or a resumed checkpoint) continues this epoch with these sums.
      progress_.partial_totals = torch::stack(gather_rows(engine, totals.to(torch::kCPU)));
      progress_.partial_record = record;
    }
    progress_.history.total_steps = progress_.global_step;
    run.visible = progress_.visible_history();
    return pass.complete;
  }

  /// The record of the epoch so far: loss and metrics reduced over the ranks, times, the last
  /// step's hyper-parameters, the optimizer state each rank holds.
  template <class Engine>
  EpochRecord epoch_record(Engine& engine, const FitRun& run, const EpochPass& pass, const torch::Tensor& totals) {
    auto reduced = totals.clone();
    engine.all_reduce_sum(reduced);
    const auto values = run.epoch_sums->compute(reduced);
    EpochRecord record;
    record.epoch = run.state.epoch;
    record.steps = progress_.steps_into_epoch;
    record.samples = values.samples;
    record.train_loss = values.loss;
    record.train_metrics = values.metrics;
    record.seconds = pass.seconds_before + pass.clock.seconds();
    record.data_wait_seconds = pass.data_wait;
    record.samples_per_second = record.seconds > 0 ? static_cast<double>(record.samples) / record.seconds : 0.0;
    record.learning_rate = pass.last_step.learning_rate;
    record.momentum = pass.last_step.momentum;
    // Every rank's, and the most any rank holds (under ZeRO the shares differ by up to one parameter).
    const torch::Tensor state_bytes = torch::full({1}, optimizer_state_bytes(optimizer_), torch::kInt64);
    const torch::Tensor by_rank = engine.all_gather(state_bytes).to(torch::kCPU).reshape({-1});
    record.optimizer_state_bytes = by_rank.max().template item<int64_t>();
    for (int64_t r = 0; r < by_rank.size(0); ++r) {
      record.optimizer_state_bytes_by_rank.push_back(by_rank[r].template item<int64_t>());
    }
    return record;
  }

  Module& module_;
  const data::AnyDataset<Batch>& train_;
  torch::optim::Optimizer& optimizer_;
  Criterion& criterion_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
};

}  // namespace trainloop::detail
