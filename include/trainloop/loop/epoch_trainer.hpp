#pragma once
/// @file
/// @brief One epoch of training (or the rest of one): batches from this process's shard, the
/// mode's forward/backward, optimizer steps per accumulation window, step-level callbacks, the
/// epoch's record. The same code for every mode (it sees the engine interface only).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/gather_rows.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/history.hpp>
#include <trainloop/loop/batch_memory_format.hpp>
#include <trainloop/loop/epoch_batch_plan.hpp>
#include <trainloop/loop/loader_for.hpp>
#include <trainloop/loop/optimizer_step.hpp>
#include <trainloop/loop/shard_indices.hpp>
#include <trainloop/metrics/metric_accumulator.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/optim/hyperparameters.hpp>
#include <trainloop/optim/optimizer_state_bytes.hpp>
#include <trainloop/options.hpp>
#include <trainloop/precision/autocast.hpp>
#include <trainloop/precision/grad_scaler.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>

namespace trainloop::detail {

/// Trains epochs for a FitRunner; holds references only (the runner owns the scaler and the
/// pointer to the current epoch's sums, which a checkpoint written mid-epoch reads).
template <class Module, class Batch>
class EpochTrainer {
 public:
  EpochTrainer(Module& module, const data::AnyDataset<Batch>& train, torch::optim::Optimizer& optimizer,
               Criterion& criterion, const TrainLoopOptions& options, TrainingProgress& progress,
               std::optional<GradScaler>& scaler, MetricAccumulator*& epoch_sums)
      : module_(module),
        train_(train),
        optimizer_(optimizer),
        criterion_(criterion),
        options_(options),
        progress_(progress),
        scaler_(scaler),
        epoch_sums_(epoch_sums) {}

  /// Trains (the rest of) one epoch. Returns true when the epoch is complete (its record appended
  /// to the History), false when it stopped inside (step limit, agreed stop): the progress then
  /// holds the position, and the partial record and sums.
  template <ModeEngine Engine>
  /// `full_plan` is the fit's plan of a whole epoch: an epoch from its start follows it (the
  /// counts per rank do not depend on the epoch), one resumed inside plans its rest.
  bool run(Engine& engine, const DataShard& shard, const EpochBatchPlan& full_plan, TrainState& state,
           CallbackList& active, const Stopwatch& fit_clock, int64_t end_step, History& visible) {
    Stopwatch epoch_clock;
    const double seconds_before = progress_.seconds_into_epoch;
    // The time this thread waits for the loader: from the end of one batch's work (or the loader's
    // start) until the next batch is in hand. Summed per batch, two clock reads each.
    double data_wait = progress_.data_wait_into_epoch;
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
    // Every rank runs plan.batches() micro-batches; with exact uneven batches a rank's last one may
    // be short or empty, and its loss weighs by its samples (loop/epoch_batch_plan.hpp).
    const bool exact = exact_uneven_batches(engine, options_);
    const EpochBatchPlan plan = start_position == 0
                                    ? full_plan
                                    : plan_epoch(train_.size(), shard, options_, exact, progress_.sampler_seed, start_position);
    auto indices = shard_indices(train_.size(), shard, true, options_, state.epoch, progress_.sampler_seed,
                                 start_position, /*pad_training=*/!exact);
    auto loader = loader_for(train_, std::move(indices), options_.batch_size(), options_.drop_last(), options_,
                             engine.device());
    const int64_t accumulation = options_.grad_accumulation_steps();
    const bool channels_last = nn::uses_channels_last(options_.memory_format(), module_);
    const int64_t batches_done = progress_.batches_into_epoch;
    const int64_t remaining_batches = plan.batches();
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
    Stopwatch waiting;
    auto next = loader.begin();
    for (int64_t k = 0; k < remaining_batches; ++k) {
      if (k > 0 && next != loader.end()) ++next;
      // None: this rank has no samples in micro-batch k (exact uneven batches, the epoch's last).
      std::optional<Batch> micro_batch;
      if (next != loader.end()) micro_batch.emplace(std::move(*next));
      data_wait += waiting.seconds();
      struct RestartOnExit {  // every way out of the body (continue, break) ends this batch's work
        Stopwatch& clock;
        ~RestartOnExit() { clock = Stopwatch(); }
      } restart_waiting{waiting};
      TRAINLOOP_CHECK(micro_batch.has_value() == (plan.samples(shard.rank, k) > 0), "rank ", engine.rank(),
                      (micro_batch ? " has" : " has no"), " batch ", batches_done + k + 1, " of ", batches,
                      "; expected the same micro-batch count on every rank (a dataset whose size changed?)");
      const int64_t index = state.batch;
      const int64_t window = std::min(accumulation, batches - window_start);
      const bool last_in_window = index + 1 == window_start + window;
      new_micro_batch = true;
      if (micro_batch) {
        if constexpr (is_example_batch_v<Batch>) {
          for (auto& cb : active) cb->on_train_batch(state, micro_batch->data, micro_batch->target);
        }
        auto forward = [this, first_batch, channels_last, device = engine.device()](Module& replica, const Batch& b) {
          AutocastGuard autocast(options_.precision(), device);  // in the replica's own thread
          return forward_batch(replica, batch_in_memory_format(b, channels_last), criterion_, first_batch);
        };
        const double loss_scale = scaler_ ? scaler_->scale() : 1.0;
        const double weight = plan.gradient_weight(shard.rank, k);  // 1.0 unless batches are uneven
        engine.train_micro_batch(*micro_batch, forward, loss_scale * weight / static_cast<double>(window),
                                 last_in_window, sink);
        first_batch = false;
      } else if constexpr (TrainsWithoutSamples<Engine>) {
        engine.train_without_samples(last_in_window);
      }
      state.batch = index + 1;
      state.epoch_seconds = seconds_before + epoch_clock.seconds();
      state.fit_seconds = fit_clock.seconds();
      for (auto& cb : active) cb->on_batch_end(state);
      if (!last_in_window) continue;

      const StepHyperparameters used =
          optimizer_step(engine, module_, optimizer_, scaler_, options_.clip_grad_norm(), active, state);
      step_lr = used.learning_rate;
      step_momentum = used.momentum;
      if (scaler_) progress_.grad_scaler_state = scaler_->state();
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
          start_position + static_cast<uint64_t>(plan.combined_samples_before(state.batch - batches_done));
      progress_.seconds_into_epoch = seconds_before + epoch_clock.seconds();
      progress_.data_wait_into_epoch = data_wait;
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
    record.data_wait_seconds = data_wait;
    record.samples_per_second = record.seconds > 0 ? static_cast<double>(record.samples) / record.seconds : 0.0;
    record.learning_rate = step_lr;
    record.momentum = step_momentum;
    // Every rank's, and the most any rank holds (under ZeRO the shares differ by up to one parameter).
    const torch::Tensor state_bytes = torch::full({1}, optimizer_state_bytes(optimizer_), torch::kInt64);
    const torch::Tensor by_rank = engine.all_gather(state_bytes).to(torch::kCPU).reshape({-1});
    record.optimizer_state_bytes = by_rank.max().template item<int64_t>();
    for (int64_t r = 0; r < by_rank.size(0); ++r) {
      record.optimizer_state_bytes_by_rank.push_back(by_rank[r].template item<int64_t>());
    }
    state.running_loss = nullptr;
    state.last_loss = nullptr;
    if (complete) {
      progress_.history.epochs.push_back(record);
      progress_.epochs_completed = state.epoch;
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
    visible = progress_.visible_history();
    return complete;
  }

 private:
  Module& module_;
  const data::AnyDataset<Batch>& train_;
  torch::optim::Optimizer& optimizer_;
  Criterion& criterion_;
  const TrainLoopOptions& options_;
  TrainingProgress& progress_;
  std::optional<GradScaler>& scaler_;
  MetricAccumulator*& epoch_sums_;
};

}  // namespace trainloop::detail
