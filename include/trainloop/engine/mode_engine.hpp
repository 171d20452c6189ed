#pragma once
/// @file
/// @brief The interface between the loop and a gpu_mode: the only code that knows about devices,
/// replicas, ranks and collectives.
///
/// Each policy type (gpu_mode::Single, gpu_mode::DataParallel, gpu_mode::DistributedDataParallel,
/// gpu_mode::FullyShardedDataParallel, or a user's) names an engine class template, `Policy::engine<Module>`, that the loop instantiates for the model's
/// module type. The loop, metrics and callbacks talk to the engine only through the members
/// checked by the ModeEngine concept below:
///
/// | member                                   | meaning                                                          |
/// |------------------------------------------|------------------------------------------------------------------|
/// | is_main()                                | true on the process that prints and writes files (rank 0)        |
/// | rank(), world_size()                     | this process's rank and the number of ranks (1 without DDP)      |
/// | device()                                 | where batches and metric sums live on this process               |
/// | data_shard()                             | which part of every dataset this process reads (sampler choice)  |
/// | all_reduce_sum(tensor)                   | in-place sum across ranks                                        |
/// | all_gather(tensor)                       | every rank's tensor (same shape), stacked: [world_size, ...]     |
/// | any_rank(flag)                           | true on every rank if it is true on any (stop agreement)         |
/// | barrier()                                | waits for every rank                                             |
/// | prepare()                                | places the model, builds replicas or joins the process group;   |
/// |                                          | idempotent, called before every fit(), evaluate(), predict()     |
/// | begin_fit(optimizer), end_fit()          | what lives only during one fit() (DDP's gradient hooks); end_fit |
/// |                                          | always runs, also when training throws                           |
/// | train_micro_batch(batch, fwd, scale, sync, sink) | forward + backward, gradients reduced as the mode does   |
/// | before_optimizer_step(), after_optimizer_step()  | finish gradient reduction / refresh replicas              |
/// | eval_batch(batch, fwd, sink)             | forward without gradients                                        |
///
/// A mode may also define optional members (optimizer_step for the whole step,
/// train_without_samples for exact uneven batches, gradients_agree, stepped_parameters,
/// clip_grad_norm, step_optimizer, zero_grad, save_optimizer_state, load_optimizer_state,
/// unshard_parameters, reshard_parameters, evaluates_in_lockstep, parameter_shares,
/// load_parameter_shares, run_fit): engine/optional_members.hpp lists every one with what the
/// loop does without it.
///
/// A mode that trains in one process derives its engine from OneProcessEngine
/// (engine/one_process_engine.hpp), which holds every identity member of the table (rank 0 of 1,
/// collectives that return their input, nothing to prepare or finish), and writes only its real
/// work: device(), train_micro_batch and eval_batch (docs/snippets/extending.cpp: a whole mode in
/// 44 lines). The multi-process modes share theirs in gpu_mode/rank_engine.hpp.
///
/// Why prepare() is separate from fit: evaluate() and predict() before the first fit() must see
/// the model where training would put it (on the GPU, in the process group, replicated), or they
/// compute something else (each rank's own shard, unreduced; a CPU model fed CUDA batches). Why
/// begin_fit()/end_fit(): a second TrainLoop over the same model must not find the first loop's
/// gradient hooks still attached.
///
/// `fwd(module, batch)` returns a StepOutput; the engine calls `sink(const StepOutput&)` once per
/// shard of the batch, on the loop's thread, so metric sums need no locks.

#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <concepts>
#include <cstdint>
#include <string>

namespace trainloop {

/// @brief The part of each dataset a process reads: shard `rank` of `world_size` strided shards.
struct DataShard {
  int64_t rank = 0;        ///< this process's shard
  int64_t world_size = 1;  ///< number of shards
};

/// @brief What every gpu_mode engine provides to the loop (see the table above).
template <class Engine>
concept ModeEngine = requires(Engine& engine, const Engine& const_engine, torch::Tensor& tensor, bool flag,
                              torch::optim::Optimizer& optimizer) {
  { const_engine.is_main() } -> std::convertible_to<bool>;
  { const_engine.rank() } -> std::convertible_to<int64_t>;
  { const_engine.world_size() } -> std::convertible_to<int64_t>;
  { const_engine.device() } -> std::convertible_to<torch::Device>;
  { const_engine.data_shard() } -> std::convertible_to<DataShard>;
  engine.all_reduce_sum(tensor);
  { engine.all_gather(tensor) } -> std::convertible_to<torch::Tensor>;
  { engine.any_rank(flag) } -> std::convertible_to<bool>;
  engine.barrier();
  engine.prepare();
  engine.begin_fit(optimizer);
  engine.end_fit();
  engine.before_optimizer_step();
  engine.after_optimizer_step();
};

namespace detail {
/// Stand-ins for the loop's forward and metric sink, only to check an engine's batch members
/// (declared, never defined: used in unevaluated requires-expressions only).
struct ForwardArchetype {
  template <class Module, class Batch>
  StepOutput operator()(Module&, const Batch&) const;
};
struct SinkArchetype {
  void operator()(const StepOutput&) const;
};
}  // namespace detail

/// @brief A ModeEngine that can also train and evaluate batches of type `Batch`: every member
/// the loop calls. Checked for a compile-time mode and for each mode a run-time choice can pick,
/// so a user's engine that misses one fails with the member's name instead of deep inside the loop.
template <class Engine, class Batch>
concept ModeEngineFor = ModeEngine<Engine> &&
    requires(Engine& engine, const Batch& batch, detail::ForwardArchetype forward, detail::SinkArchetype sink,
             double loss_scale, bool synchronize) {
      engine.train_micro_batch(batch, forward, loss_scale, synchronize, sink);
      engine.eval_batch(batch, forward, sink);
    };

namespace detail {
/// Whether an engine can train batches of type `Batch` with its module (true unless a mode
/// specialises it: DataParallel needs replicable modules and splittable batches). Used by
/// gpu_mode::Any so a run-time choice compiles for every model, and names the mode that cannot.
template <class Engine, class Batch>
inline constexpr bool engine_supports_v = true;

template <class Module, class... Modes>
class AnyEngine;  // gpu_mode/parse.hpp

/// Whether `Engine` is the run-time choice of modes (TrainLoop visits it instead of calling it).
template <class Engine>
inline constexpr bool is_any_engine_v = false;
template <class Module, class... Modes>
inline constexpr bool is_any_engine_v<AnyEngine<Module, Modes...>> = true;

/// What an engine that does not support a model or batch type says about it: its own
/// `cannot_train` text (each mode states its limits in its own words).
template <class Engine>
std::string engine_cannot_train_text() {
  if constexpr (requires { Engine::cannot_train; }) {
    return std::string(Engine::cannot_train);
  } else {
    return "the chosen gpu mode cannot train this model or batch type";
  }
}
}  // namespace detail

}  // namespace trainloop
