#pragma once
/// @file
/// @brief evaluate() and predict() for every gpu_mode: each process runs its evaluation shard
/// (every sample exactly once over all ranks); sums are reduced, predictions gathered in order.
///
/// An engine whose evaluation batches are collectives (evaluates_in_lockstep: fsdp at sharding
/// full gathers each unit as an operator reads it, engine/optional_members.hpp) needs every rank
/// to run as many: the ranks agree on the most any has (one all-gather), and a rank out of
/// batches (the short shard of an uneven dataset, or a rank without samples) runs the dataset's
/// first sample as a batch of one, whose output nobody counts. The model is then never gathered
/// whole; an engine not in lockstep makes it whole first (unshard_parameters).

#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/metrics/metric_accumulator.hpp>
#include <trainloop/loop/loader_for.hpp>
#include <trainloop/loop/shard_indices.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/history.hpp>
#include <trainloop/loop/batch_memory_format.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/options.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/test_kill_point.hpp>
#include <trainloop/precision/autocast.hpp>

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace trainloop::detail {

/// Runs `evaluate_batch(batch, counted)` on every batch of `loader` (`own_batches` of them),
/// counted; under lockstep (see this file's comment) then on the dataset's first sample until
/// this rank ran as many batches as the rank with the most, not counted.
template <class Batch, ModeEngine Engine, class Loader, class EvaluateBatch>
void run_evaluation_batches(Engine& engine, const data::AnyDataset<Batch>& dataset, Loader& loader, int64_t own_batches,
                            const TrainLoopOptions& options_, EvaluateBatch&& evaluate_batch) {
  int64_t most = own_batches;
  if (evaluates_in_lockstep(engine) && engine.world_size() > 1) {  // agreed before any batch gathers a unit
    torch::Tensor count = torch::full({1}, static_cast<double>(own_batches),
                                      torch::TensorOptions().dtype(torch::kFloat64).device(engine.device()));
    const torch::Tensor counts = engine.all_gather(count);
    most = static_cast<int64_t>(counts.max().item<double>());
  }
  for (auto&& batch : loader) {
    progress::progress_beacon().advance();  // a batch evaluated is progress
    evaluate_batch(batch, true);
  }
  if (most <= own_batches) return;
  auto first = loader_for(dataset, std::vector<size_t>{0}, 1, false, options_, engine.device());
  for (auto&& batch : first) {
    for (int64_t extra = own_batches; extra < most; ++extra) {
      progress::progress_beacon().advance();
      evaluate_batch(batch, false);  // the other ranks' gathers need this rank; its output is discarded
    }
  }
}

/// The evaluation batches of `indices` (no drop_last).
inline int64_t evaluation_batches(size_t samples, int64_t batch_size) {
  return (static_cast<int64_t>(samples) + batch_size - 1) / batch_size;
}

/// Loss and metrics over `dataset`: this process's shard, sums reduced over every rank.
template <class Module, class Batch, ModeEngine Engine>
EvalResult evaluate_dataset(Engine& engine, Module& module_, const data::AnyDataset<Batch>& dataset,
                          Criterion& criterion_, const TrainLoopOptions& options_) {
  TRAINLOOP_CHECK(dataset.has_value(), "evaluate() needs a dataset");
  TRAINLOOP_CHECK(dataset.size() > 0, "the evaluation dataset is empty; expected at least one sample");
  // A sharded mode's parameters whole on every rank (a collective), unless batches gather them.
  if (!evaluates_in_lockstep(engine)) unshard_parameters(engine);
  const bool was_training = module_.is_training();
  module_.eval();
  progress::test_kill_point(progress::KillPoint::Evaluation);
  MetricAccumulator sums(options_.metrics(), engine.device());
  auto indices = shard_indices(dataset.size(), engine.data_shard(), false, options_, 0);
  const int64_t own_batches = evaluation_batches(indices.size(), options_.effective_eval_batch_size());
  auto loader = loader_for(dataset, std::move(indices), options_.effective_eval_batch_size(), false, options_,
                           engine.device());
  const bool channels_last = nn::uses_channels_last(options_.memory_format(), module_);
  auto forward = [&criterion_, &options_, channels_last, device = engine.device()](Module& replica, const Batch& b) {
    AutocastGuard autocast(options_.precision(), device);  // evaluated in the precision it trains in
    return forward_batch(replica, batch_in_memory_format(b, channels_last), criterion_, false);
  };
  run_evaluation_batches(engine, dataset, loader, own_batches, options_, [&](const Batch& batch, bool counted) {
    engine.eval_batch(batch, forward, [&](const StepOutput& out) {
      if (!counted) return;
      sums.add_loss(out.loss, out.samples);
      if (out.output.defined() && out.target.defined()) sums.add_outputs(out.output, out.target);
    });
  });
  auto totals = sums.packed_totals();
  engine.all_reduce_sum(totals);
  auto values = sums.compute(totals);
  module_.train(was_training);
  return EvalResult{values.loss, values.samples, values.metrics};
}

/// The model's outputs for every sample of `dataset`, in dataset order, on the CPU, on every
/// rank: each rank predicts its evaluation shard, the shards are gathered and interleaved back
/// (shard r holds samples r, r+world, ...).
template <class Module, class Batch, ModeEngine Engine>
torch::Tensor predict_dataset(Engine& engine, Module& module_, const data::AnyDataset<Batch>& dataset,
                            const TrainLoopOptions& options_) {
  TRAINLOOP_CHECK(dataset.has_value() && dataset.size() > 0, "predict() needs a non-empty dataset");
  if (!evaluates_in_lockstep(engine)) unshard_parameters(engine);
  const bool was_training = module_.is_training();
  module_.eval();
  const auto shard = engine.data_shard();
  TRAINLOOP_CHECK(static_cast<int64_t>(dataset.size()) >= shard.world_size, "predict() over ", dataset.size(),
                  " samples with ", shard.world_size, " ranks; expected at least one sample per rank");
  auto indices = shard_indices(dataset.size(), shard, false, options_, 0);
  const int64_t local_count = static_cast<int64_t>(indices.size());
  const int64_t own_batches = evaluation_batches(indices.size(), options_.effective_eval_batch_size());
  auto loader = loader_for(dataset, std::move(indices), options_.effective_eval_batch_size(), false, options_,
                           engine.device());
  const bool channels_last = nn::uses_channels_last(options_.memory_format(), module_);
  auto forward = [&options_, channels_last, device = engine.device()](Module& replica, const Batch& b) {
    AutocastGuard autocast(options_.precision(), device);
    StepOutput out;
    out.samples = batch_size_of(b);
    if constexpr (HasCustomContract<Module, Batch>) {
      out.output = replica.batch_predictions(b).output;
    } else {
      out.output = replica.forward(nn::input_in_memory_format(b.data, channels_last));
    }
    // Autocast's bf16/fp16 outputs come back as float32, as they would without autocast.
    const auto type = out.output.scalar_type();
    if (options_.precision() != Precision::fp32 && (type == torch::kBFloat16 || type == torch::kHalf)) {
      out.output = out.output.to(torch::kFloat32);
    }
    return out;
  };
  std::vector<torch::Tensor> outputs;
  run_evaluation_batches(engine, dataset, loader, own_batches, options_, [&](const Batch& batch, bool counted) {
    engine.eval_batch(batch, forward, [&](const StepOutput& out) {
      if (counted) outputs.push_back(out.output);
    });
  });
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

}  // namespace trainloop::detail
