#pragma once
/// @file
/// @brief The epoch loop shared by every gpu_mode: it sees the mode only through the engine
/// interface (gpu_mode/mode_interface.hpp), so one loop serves one device, replicas and ranks.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/data/shard_sampler.hpp>
#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/metric_accumulator.hpp>
#include <trainloop/gpu_mode/mode_interface.hpp>
#include <trainloop/history.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/options.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cmath>
#include <memory>
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

/// The sampler of this process's part of a dataset.
/// Training shards are shuffled per epoch and padded so every rank runs the same number of steps;
/// evaluation shards are neither, so every sample is counted exactly once over all ranks.
inline data::ShardSampler shard_sampler(size_t dataset_size, const DataShard& shard, bool training,
                                        const TrainLoopOptions& options) {
  return data::ShardSampler(dataset_size, static_cast<size_t>(shard.rank), static_cast<size_t>(shard.world_size),
                            data::ShardSamplerOptions()
                                .shuffle(training && options.shuffle())
                                .seed(options.seed())
                                .pad_to_equal(training)
                                .drop_last(false));
}

/// This process's indices of a dataset for one epoch (see shard_sampler()).
inline std::vector<size_t> shard_indices(size_t dataset_size, const DataShard& shard, bool training,
                                         const TrainLoopOptions& options, int64_t epoch) {
  auto sampler = shard_sampler(dataset_size, shard, training, options);
  sampler.set_epoch(static_cast<uint64_t>(epoch));
  return sampler.indices();
}

/// Runs fit() and evaluate() for one engine. Holds references only: the TrainLoop owns everything.
template <class Module, class Batch>
class FitRunner {
 public:
  FitRunner(Module& module, const data::AnyDataset<Batch>& train, const data::AnyDataset<Batch>& validation,
            torch::optim::Optimizer& optimizer, Criterion& criterion, const TrainLoopOptions& options)
      : module_(module),
        train_(train),
        validation_(validation),
        optimizer_(optimizer),
        criterion_(criterion),
        options_(options) {}

  template <ModeEngine Engine>
  History fit(Engine& engine, const FitLength& length, const CallbackList& callbacks) {
    options_.validate();
    TRAINLOOP_CHECK(train_.has_value(), "fit() needs a training dataset");
    TRAINLOOP_CHECK(train_.size() > 0, "the training dataset is empty; expected at least one sample");
    engine.begin_fit(optimizer_);
    // What lives only during this fit (DDP's gradient hooks) goes with it, also on an exception.
    struct EndFit {
      Engine& engine;
      ~EndFit() { engine.end_fit(); }
    } end_fit{engine};
    torch::manual_seed(options_.seed());

    CallbackList active;
    for (const auto& cb : callbacks) {
      TRAINLOOP_CHECK(cb != nullptr, "a null callback was given to fit()");
      if (!cb->main_process_only() || engine.is_main()) active.push_back(cb);
    }

    const auto shard = engine.data_shard();
    const int64_t shard_size = static_cast<int64_t>(shard_sampler(train_.size(), shard, true, options_).num_samples());
    const int64_t batch = options_.batch_size();
    const int64_t batches_per_epoch = options_.drop_last() ? shard_size / batch : (shard_size + batch - 1) / batch;
    TRAINLOOP_CHECK(batches_per_epoch > 0, "an epoch would have no batch: ", shard_size,
                    " training samples per process with batch size ", batch, " and drop_last; expected at least ",
                    batch, " samples per process");
    const int64_t accumulation = options_.grad_accumulation_steps();
    const int64_t steps_per_epoch = (batches_per_epoch + accumulation - 1) / accumulation;

    History history;
    TrainState state;
    state.world_size = engine.world_size();
    state.batches_per_epoch = batches_per_epoch;
    state.history = &history;
    if (length.iteration_count() > 0) {
      state.planned_steps = length.iteration_count();
      state.planned_epochs = (state.planned_steps + steps_per_epoch - 1) / steps_per_epoch;
    } else {
      state.planned_epochs = length.epoch_count();
      state.planned_steps = state.planned_epochs * steps_per_epoch;
    }

    Stopwatch fit_clock;
    for (auto& cb : active) cb->on_fit_begin(state);
    for (int64_t epoch = 1; epoch <= state.planned_epochs && state.step < state.planned_steps; ++epoch) {
      state.epoch = epoch;
      state.batch = 0;
      state.epoch_samples = 0;
      for (auto& cb : active) cb->on_epoch_begin(state);
      EpochRecord record = with_error_context([&] { return train_epoch(engine, shard, state, active, fit_clock); },
                                              [&] {
                                                return concat("trainloop: while training epoch ", state.epoch,
                                                              ", after batch ", state.batch, " of ",
                                                              state.batches_per_epoch, " (rank ", engine.rank(), ")");
                                              });
      if (validation_.has_value()) {
        record.validation = evaluate(engine, validation_);
        for (auto& cb : active) cb->on_validation_end(state, *record.validation);
      }
      history.epochs.push_back(record);
      history.total_steps = state.step;
      for (auto& cb : active) cb->on_epoch_end(state, history.epochs.back());
      TRAINLOOP_CHECK(!options_.stop_on_non_finite_loss() || std::isfinite(record.train_loss),
                      "the training loss of epoch ", epoch, " is ", record.train_loss,
                      "; expected a finite number (lower the learning rate, or turn off stop_on_non_finite_loss)");
      if (engine.any_rank(state.stop_requested)) {
        history.stop_reason = state.stop_reason.empty() ? "a callback on another rank asked to stop" : state.stop_reason;
        break;
      }
    }
    for (auto& cb : active) cb->on_fit_end(state, history);
    return history;
  }

  /// Loss and metrics over `dataset`, this process's shard, reduced over every rank.
  template <ModeEngine Engine>
  EvalResult evaluate(Engine& engine, const data::AnyDataset<Batch>& dataset) {
    TRAINLOOP_CHECK(dataset.has_value(), "evaluate() needs a dataset");
    TRAINLOOP_CHECK(dataset.size() > 0, "the evaluation dataset is empty; expected at least one sample");
    const bool was_training = module_.is_training();
    module_.eval();
    MetricAccumulator sums(options_.metrics(), engine.device());
    auto indices = shard_indices(dataset.size(), engine.data_shard(), false, options_, 0);
    data::BatchLoader<data::AnyDataset<Batch>> loader(std::make_shared<data::AnyDataset<Batch>>(dataset), std::move(indices),
                                                      static_cast<size_t>(options_.effective_eval_batch_size()),
                                                      static_cast<size_t>(options_.num_workers()), false);
    auto forward = [this](Module& replica, const Batch& b) { return forward_batch(replica, b, criterion_, false); };
    for (auto&& batch : loader) {
      engine.eval_batch(batch, forward, [&](const StepOutput& out) {
        sums.add_loss(out.loss, out.samples);
        if (out.output.defined() && out.target.defined()) sums.add_outputs(out.output, out.target);
      });
    }
    auto totals = sums.packed_totals();
    engine.all_reduce_sum(totals);
    auto values = sums.compute(totals);
    module_.train(was_training);
    return EvalResult{values.loss, values.samples, values.metrics};
  }

  /// The model's outputs for every sample of `dataset`, in dataset order, on the CPU, on every
  /// rank: each rank predicts its evaluation shard, the shards are gathered and interleaved back
  /// (shard r holds samples r, r+world, ...).
  template <ModeEngine Engine>
  torch::Tensor predict(Engine& engine, const data::AnyDataset<Batch>& dataset) {
    TRAINLOOP_CHECK(dataset.has_value() && dataset.size() > 0, "predict() needs a non-empty dataset");
    const bool was_training = module_.is_training();
    module_.eval();
    const auto shard = engine.data_shard();
    TRAINLOOP_CHECK(static_cast<int64_t>(dataset.size()) >= shard.world_size, "predict() over ", dataset.size(),
                    " samples with ", shard.world_size, " ranks; expected at least one sample per rank");
    auto indices = shard_indices(dataset.size(), shard, false, options_, 0);
    const int64_t local_count = static_cast<int64_t>(indices.size());
    data::BatchLoader<data::AnyDataset<Batch>> loader(std::make_shared<data::AnyDataset<Batch>>(dataset), std::move(indices),
                                                      static_cast<size_t>(options_.effective_eval_batch_size()),
                                                      static_cast<size_t>(options_.num_workers()), false);
    auto forward = [](Module& replica, const Batch& b) {
      StepOutput out;
      out.samples = batch_size_of(b);
      if constexpr (HasCustomContract<Module, Batch>) {
        out.output = replica.batch_predictions(b).output;
      } else {
        out.output = replica.forward(b.data);
      }
      return out;
    };
    std::vector<torch::Tensor> outputs;
    for (auto&& batch : loader) {
      engine.eval_batch(batch, forward, [&](const StepOutput& out) { outputs.push_back(out.output); });
    }
    module_.train(was_training);
    torch::Tensor local = outputs.empty() ? torch::Tensor() : torch::cat(outputs);
    if (shard.world_size == 1) return local.to(torch::kCPU);

    // Shards differ by at most one sample: pad to the largest, gather, drop the padding.
    const int64_t world = shard.world_size;
    const int64_t largest = (static_cast<int64_t>(dataset.size()) + world - 1) / world;
    std::vector<int64_t> shape = local.sizes().vec();
    shape[0] = largest;
    torch::Tensor padded = torch::zeros(shape, local.options());
    padded.narrow(0, 0, local_count).copy_(local);
    torch::Tensor gathered = engine.all_gather(padded).to(torch::kCPU);  // [world, largest, ...]
    // Row i of the dataset is row i / world of shard i % world: transpose the first two
    // dimensions and flatten them, then cut the padding off the end.
    std::vector<int64_t> flat_shape = shape;
    flat_shape[0] = world * largest;
    return gathered.transpose(0, 1).reshape(flat_shape).narrow(0, 0, static_cast<int64_t>(dataset.size()));
  }

 private:
  template <ModeEngine Engine>
  EpochRecord train_epoch(Engine& engine, const DataShard& shard, TrainState& state, CallbackList& active,
                          const Stopwatch& fit_clock) {
    Stopwatch epoch_clock;
    module_.train();
    MetricAccumulator sums(options_.metrics(), engine.device());
    state.running_loss = [&sums] { return sums.running_loss(); };

    auto indices = shard_indices(train_.size(), shard, true, options_, state.epoch);
    data::BatchLoader<data::AnyDataset<Batch>> loader(std::make_shared<data::AnyDataset<Batch>>(train_), std::move(indices),
                                                      static_cast<size_t>(options_.batch_size()),
                                                      static_cast<size_t>(options_.num_workers()), options_.drop_last());
    const int64_t accumulation = options_.grad_accumulation_steps();
    const int64_t batches = state.batches_per_epoch;
    const int64_t steps_before = state.step;
    bool first_batch = true;
    auto sink = [&](const StepOutput& out) {
      sums.add_loss(out.loss, out.samples);
      if (out.output.defined() && out.target.defined()) sums.add_outputs(out.output, out.target);
      state.epoch_samples += out.samples * state.world_size;
    };

    int64_t window_start = 0;
    for (auto&& batch : loader) {
      const int64_t index = state.batch;
      const int64_t window = std::min(accumulation, batches - window_start);
      const bool last_in_window = index + 1 == window_start + window;
      auto forward = [this, first_batch](Module& replica, const Batch& b) {
        return forward_batch(replica, b, criterion_, first_batch);
      };
      engine.train_micro_batch(batch, forward, 1.0 / static_cast<double>(window), last_in_window, sink);
      first_batch = false;
      state.batch = index + 1;
      state.epoch_seconds = epoch_clock.seconds();
      state.fit_seconds = fit_clock.seconds();
      for (auto& cb : active) cb->on_batch_end(state);
      if (!last_in_window) continue;

      engine.before_optimizer_step();
      if (options_.clip_grad_norm() > 0.0) torch::nn::utils::clip_grad_norm_(module_.parameters(), options_.clip_grad_norm());
      optimizer_.step();
      engine.after_optimizer_step();
      optimizer_.zero_grad();
      ++state.step;
      window_start = state.batch;
      for (auto& cb : active) cb->on_step_end(state);
      if (state.step >= state.planned_steps) break;
    }

    auto totals = sums.packed_totals();
    engine.all_reduce_sum(totals);
    auto values = sums.compute(totals);
    EpochRecord record;
    record.epoch = state.epoch;
    record.steps = state.step - steps_before;
    record.samples = values.samples;
    record.train_loss = values.loss;
    record.train_metrics = values.metrics;
    record.seconds = epoch_clock.seconds();
    record.samples_per_second = record.seconds > 0 ? static_cast<double>(record.samples) / record.seconds : 0.0;
    state.running_loss = nullptr;
    return record;
  }

  Module& module_;
  const data::AnyDataset<Batch>& train_;
  const data::AnyDataset<Batch>& validation_;
  torch::optim::Optimizer& optimizer_;
  Criterion& criterion_;
  const TrainLoopOptions& options_;
};

}  // namespace trainloop::detail
