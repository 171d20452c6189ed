#pragma once
/// @file
/// @brief gpu_mode::FullyShardedDataParallel's engine (the policy, its options:
/// gpu_mode/fully_sharded_data_parallel_policy.hpp): one process per device or machine (launched and
/// joined as DDP is: gpu_mode/rank_engine.hpp), each rank keeping only 1/W of the optimizer state
/// and of the reduced gradients (sharding gradients: ZeRO-2, FSDP's SHARD_GRAD_OP) and also of
/// the parameters between their uses (sharding full, the default: ZeRO-3, FSDP's FULL_SHARD).
///
/// The pieces, one owner each, none driving another: RankEngine's distributed/zero/
/// sharded_state.hpp (the parameters laid out by unit, a submodule, each cut in W chunks, once per
/// loop; this rank's pieces and their optimizer state; its own chunks at full; checkpoints), and
/// this engine's unit_gradients.hpp (each unit's gradients reduce-scattered into this rank's chunk
/// as backward completes it: per fit) and unit_parameters.hpp (full: units freed between uses,
/// gathered before the operators that read them: per fit).
///
/// The optimizer step is the loop's default (engine/optimizer_step.hpp) through its seams: this
/// rank's pieces with their reduced chunks as gradients (fp16 unscales those, every rank agrees on
/// a skip), clipping by the norm over every rank's chunks, the pieces' step (at gradients then
/// broadcast into every rank's parameters). Checkpoints are per rank once the layout exists
/// (distributed/zero/shard_checkpoint.hpp): nothing gathered; they resume in any mode, level and
/// world size. Evaluation inside a fit runs unit by unit at full, every rank as many batches as
/// the one with the most (evaluates_in_lockstep, loop/evaluation.hpp); nothing gathers the whole
/// model but a callback that asks (TrainState::gather_whole_weights) and the fit's end, unless
/// whole_model_after_fit(false).

#include <trainloop/distributed/zero/sharded_gradient_norm.hpp>
#include <trainloop/distributed/zero/sharding.hpp>
#include <trainloop/distributed/zero/unit_gather_mode.hpp>
#include <trainloop/distributed/zero/unit_gradients.hpp>
#include <trainloop/distributed/zero/unit_parameters.hpp>
#include <trainloop/distributed/zero/units.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/fully_sharded_data_parallel_policy.hpp>
#include <trainloop/gpu_mode/multi_process.hpp>
#include <trainloop/gpu_mode/rank_engine.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <exception>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

namespace detail {

/// The engine of gpu_mode::FullyShardedDataParallel (this file's comment).
template <class Module>
class FullyShardedEngine : public RankEngine<Module, gpu_mode::FullyShardedDataParallel> {
  using Base = RankEngine<Module, gpu_mode::FullyShardedDataParallel>;
  using Base::group_;
  using Base::mode_;
  using Base::module_;

 public:
  FullyShardedEngine(const gpu_mode::FullyShardedDataParallel& mode, std::shared_ptr<Module> module)
      : Base(mode, std::move(module)) {
    this->sharded_.shard(mode_.sharding() == distributed::Sharding::Full,
                         [module = module_, names = mode_.sharding_units()] { return distributed::assign_units(*module, names).unit_of; });
  }

  /// Every rank holding rank 0's state, then the sharded state (ShardedState::begin_fit: the
  /// layout made in the first fit, this rank's share of a whole state loaded before), this fit's
  /// gradient hooks and, at full, its sharded parameters.
  void begin_fit(torch::optim::Optimizer& optimizer) {
    if (parameters_) {  // kept by a fit with whole_model_after_fit(false): whole again, as join_fit reads them
      parameters_->release(true);
      parameters_.reset();
    }
    this->join_fit();
    const distributed::Sharding level = mode_.sharding();
    const bool sharded = this->sharded_.begin_fit(optimizer, group_->world_size(), group_->rank(), [&] {
      sharded_model_.check(*module_, level);
      distributed::check_trainable_parameters_in(*module_, optimizer, level);
    });
    if (!sharded) return;  // one rank: nothing to shard, trains as gpu_mode::Single
    gradients_.emplace(this->sharded_.layout(), *group_);
    if (level == distributed::Sharding::Full) parameters_.emplace(this->sharded_.layout(), *group_, this->sharded_.own_chunks());
  }
  /// Each parameter its own tensor again, whole (a collective, unless the fit is ending with an
  /// exception: the other ranks may not be listening; UnitParameters::release says what is lost),
  /// and this fit's gradient hooks removed. The optimizer's share stays until the next fit: a
  /// checkpoint saved now still gathers it.
  void end_fit() noexcept {
    const bool clean = std::uncaught_exceptions() == 0;
    if (parameters_ && clean && !mode_.whole_model_after_fit()) {
      parameters_->free_all();  // each rank keeps its chunks, and evaluates unit by unit after the fit
    } else if (parameters_) {
      try {
        parameters_->release(clean, !mode_.elastic());
      } catch (...) {
        try {
          parameters_->release(false, !mode_.elastic());
        } catch (...) {
        }
      }
      parameters_.reset();
    }
    gradients_.reset();
    this->leave_fit();
  }

  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool synchronize, Sink&& sink) {
    if (gradients_) gradients_->begin_micro_batch(synchronize);
    sink(with_units_gathered([&] {
      StepOutput out = forward(*module_, batch_to_device(batch, this->device_));
      (loss_scale == 1.0 ? out.loss : out.loss * loss_scale).backward();
      return out;
    }));
  }
  /// A batch evaluated without gradients. At full inside a fit: as a training micro-batch's
  /// forward (units gathered by the operators that read them, all freed after; one gathered whole
  /// for a callback or a checkpoint is resharded first, keeping what changed in it), so every rank
  /// must evaluate as many batches (evaluates_in_lockstep).
  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    if (!parameters_) return Base::eval_batch(batch, std::forward<Forward>(forward), std::forward<Sink>(sink));
    torch::NoGradGuard no_grad;  // no graph: nothing saved holds a unit, freed as the next is gathered
    sink(with_units_gathered([&] { return forward(*module_, batch_to_device(batch, this->device_)); }));
  }
  /// True while evaluation gathers units as its operators run (a fit at full, or after one with
  /// whole_model_after_fit(false)): the loop then runs as many evaluation batches on every rank.
  bool evaluates_in_lockstep() const { return parameters_.has_value(); }
  /// Exact uneven batches: a rank without samples in this micro-batch joins the reductions in
  /// finalize(). Sharding full cannot: the other ranks gather parameters as their operators run.
  void train_without_samples(bool synchronize) {
    TRAINLOOP_CHECK(!parameters_, "exact_uneven_batches gave rank ", this->rank(), " a micro-batch without samples, "
                    "and sharding is full: the other ranks gather parameters as their operators run, which a rank "
                    "without samples cannot follow; expected exact_uneven_batches off or sharding gradients");
    if (gradients_) gradients_->begin_micro_batch(synchronize);
  }
  /// Reduces the units backward did not complete (unused parameters, a rank without samples).
  void before_optimizer_step() {
    if (gradients_) gradients_->finalize();
    this->commit_step();  // elastic training: the reduced step committed (gpu_mode/rank_engine.hpp)
  }

  // ---- the optimizer step's seams (engine/optimizer_step.hpp) ----
  /// What the step updates: this rank's pieces, their gradients its reduced chunks.
  std::vector<torch::Tensor> stepped_parameters(Module& module) {
    if (!gradients_) return module.parameters();
    return this->sharded_.shard().pieces_with_gradients(gradients_->chunks());
  }
  /// Clipping by the norm over every rank's chunks (a collective).
  void clip_grad_norm(Module& module, double max_norm) {
    if (!gradients_) {
      torch::nn::utils::clip_grad_norm_(module.parameters(), max_norm);
      return;
    }
    distributed::clip_sharded_gradients(this->sharded_.shard().pieces_with_gradients(gradients_->chunks()), max_norm, *group_,
                                        this->device_);
  }
  /// The step of this rank's pieces; at gradients the owners then broadcast them into every
  /// rank's parameters; at full every unit is freed first (one gathered before the step, for a
  /// callback's evaluation, would be stale after it) and the slots' memory returned.
  void step_optimizer(torch::optim::Optimizer& optimizer) {
    if (!gradients_) {
      optimizer.step();
      return;
    }
    if (parameters_) parameters_->release_slots();  // the step's temporaries take their place
    this->sharded_.shard().pieces_with_gradients(gradients_->chunks());  // frozen since the last look: no gradient
    this->sharded_.shard().step_pieces(optimizer);
    if (!parameters_) this->sharded_.shard().broadcast_pieces(*group_);
  }
  /// Every unit whole on every rank, for a checkpoint or a callback (a collective).
  void unshard_parameters() {
    if (parameters_) parameters_->unshard();
  }
  /// Frees what unshard_parameters() gathered, keeping what a callback changed (no collective).
  void reshard_parameters() {
    if (parameters_) parameters_->reshard();
  }
  /// Copies of this rank's chunks of every unit, or nothing when the parameters are whole.
  std::optional<std::vector<torch::Tensor>> parameter_shares() {
    if (!parameters_) return std::nullopt;
    return parameters_->own_chunk_copies();
  }
  /// Puts chunks parameter_shares() returned back (every rank its own, of the same moment).
  void load_parameter_shares(const std::vector<torch::Tensor>& shares) {
    TRAINLOOP_CHECK(parameters_.has_value(), "parameter shares were put back on rank ", this->rank(),
                    " whose parameters are whole; expected a fit at sharding full (the shares' own)");
    parameters_->load_own_chunks(shares);
  }
  /// The launcher's fit(), or a rank's. whole_model_after_fit(false) needs ranks started by
  /// torchrun, srun or mpirun: a spawned rank hands its model to the launching process whole.
  History run_fit(const FitActions& actions, const ResumeSpec& resume) {
    TRAINLOOP_CHECK(this->env_.has_value() || mode_.whole_model_after_fit() ||
                        mode_.sharding() != distributed::Sharding::Full,
                    "fsdp's whole_model_after_fit is false in a program that launches its own ranks; expected ranks "
                    "started by torchrun, srun or mpirun (a rank trainloop spawns hands the trained model to this "
                    "process whole, through a checkpoint) or whole_model_after_fit(true)");
    return Base::run_fit(actions, resume);
  }
  /// This rank's pieces of a per-rank checkpoint (RankEngine's, which also writes and reads the
  /// rest): at full their values are the pieces', the only copy between uses, synced first from
  /// units a callback holds whole.
  std::vector<TensorShare> checkpoint_shares(Module& module, torch::optim::Optimizer& optimizer) {
    if (parameters_) parameters_->sync_own_chunks();
    return this->sharded_.shares(module, optimizer, /*values_from_pieces=*/parameters_.has_value());
  }

 private:
  /// Runs `body` (a forward, perhaps a backward) with units gathered as its operators read them
  /// and every unit freed after, also when it throws; without sharded parameters, just runs it.
  template <class Body>
  StepOutput with_units_gathered(Body&& body) {
    if (!parameters_) return body();
    parameters_->begin_micro_batch();
    struct FreeUnits {
      distributed::UnitParameters& parameters;
      ~FreeUnits() { parameters.free_all(); }
    } free_units{*parameters_};
    distributed::UnitGatherScope gathering(*parameters_);
    return body();
  }
  std::optional<distributed::UnitGradients> gradients_;     // this fit's gradient reduction
  std::optional<distributed::UnitParameters> parameters_;   // this fit's sharded parameters (full)
  distributed::ShardedModelRecord sharded_model_;           // the parameters laid out, checked in later fits
};

}  // namespace detail
}  // namespace trainloop
