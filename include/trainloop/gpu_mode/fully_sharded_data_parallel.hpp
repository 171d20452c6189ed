#pragma once
/// @file
/// @brief gpu_mode::FullyShardedDataParallel: one process per device or machine (launched and
/// joined as DDP is: gpu_mode/rank_engine.hpp), each rank keeping only 1/W of the optimizer state
/// and of the reduced gradients (sharding gradients: ZeRO-2, FSDP's SHARD_GRAD_OP) and also of
/// the parameters between their uses (sharding full, the default: ZeRO-3, FSDP's FULL_SHARD).
///
/// The pieces, one owner each (this engine), none driving another: distributed/zero/
/// flat_layout.hpp (the parameters laid out by unit, a submodule, each cut in W chunks: once per
/// loop), unit_gradients.hpp (each unit's gradients reduce-scattered into this rank's chunk as
/// backward completes it: per fit), unit_parameters.hpp (full: units freed between uses, gathered
/// before the operators that read them: per fit), zero_optimizer_shard.hpp (this rank's pieces
/// and their optimizer state).
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

#include <trainloop/distributed/ddp/checkpoint_state.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/shard_checkpoint.hpp>
#include <trainloop/distributed/zero/sharded_gradient_norm.hpp>
#include <trainloop/distributed/zero/sharding.hpp>
#include <trainloop/distributed/zero/unit_gather_mode.hpp>
#include <trainloop/distributed/zero/unit_gradients.hpp>
#include <trainloop/distributed/zero/unit_parameters.hpp>
#include <trainloop/distributed/zero/units.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/engine/checkpoint_shares.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>
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
template <class Module>
class FullyShardedEngine;
}

namespace gpu_mode {

/// @brief Sharded data parallel training, in the style of PyTorch's FSDP:
/// `gpu_mode::FullyShardedDataParallel().procs_per_node(4)` (or `--gpu-mode fsdp`, or
/// `--gpu-mode ddp --sharding full`). The processes, devices and limits are
/// gpu_mode::MultiProcess's settings; these are the sharding's.
struct FullyShardedDataParallel : MultiProcess<FullyShardedDataParallel> {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "fsdp";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::FullyShardedEngine<Module>;

  /// What each rank keeps only 1/W of besides the optimizer state (distributed/zero/sharding.hpp):
  /// Sharding::Gradients (ZeRO-2) or Sharding::Full (ZeRO-3, the default).
  TORCH_ARG(distributed::Sharding, sharding) = distributed::Sharding::Full;
  /// The submodules (dotted paths, as named_modules() prints them) whose parameters are reduced
  /// and gathered together, like FSDP's auto-wrap policy; empty: the model's top-level children.
  /// Parameters of no unit form one more unit.
  TORCH_ARG(std::vector<std::string>, sharding_units) = {};
  /// At sharding full: whether a fit ends with every rank's model whole (the default: a
  /// collective gather of every unit, so the model after fit() is the trained one). false, for a
  /// model that does not fit one rank: each rank keeps only its chunks after fit(); its model's
  /// parameters keep their sizes but have no memory (read them through this loop: evaluate(),
  /// predict() and save_checkpoint() gather what they need; a checkpoint holds the trained
  /// weights whole). Ranks started by torchrun, srun or mpirun only: a rank trainloop's launcher
  /// spawned hands its model to the launching process whole (refused there by name). A later
  /// fit() of the same ranks gathers the model whole once at its start (every rank's state is
  /// checked against rank 0's).
  TORCH_ARG(bool, whole_model_after_fit) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::Error naming the first option out of range.
  void validate() const {
    validate_processes();
    TRAINLOOP_CHECK(sharding_ == distributed::Sharding::Gradients || sharding_ == distributed::Sharding::Full,
                    "fsdp's sharding is ", distributed::sharding_name(sharding_), "; expected gradients or full "
                    "(sharding none and optimizer are gpu_mode::DistributedDataParallel, the latter with zero(true))");
  }
};

}  // namespace gpu_mode

namespace detail {

/// The engine of gpu_mode::FullyShardedDataParallel (this file's comment).
template <class Module>
class FullyShardedEngine : public RankEngine<Module, gpu_mode::FullyShardedDataParallel> {
  using Base = RankEngine<Module, gpu_mode::FullyShardedDataParallel>;
  using Base::group_;
  using Base::mode_;
  using Base::module_;

 public:
  using Base::Base;

  /// Every rank holding rank 0's state, then the layout (made in the first fit, the same in
  /// every later one: the optimizer keys this rank's state by its pieces), this rank's share of
  /// a whole state loaded before, this fit's gradient hooks and, at full, its sharded parameters.
  void begin_fit(torch::optim::Optimizer& optimizer) {
    if (parameters_) {  // kept by a fit with whole_model_after_fit(false): whole again, as join_fit reads them
      parameters_->release(true);
      parameters_.reset();
    }
    this->join_fit();
    const distributed::Sharding level = mode_.sharding();
    distributed::ZeroOptimizerShard::check_optimizer(optimizer);
    drop_unused_loaded_layout(optimizer);
    // Joined ranks (torchrun...) keep only their share after a sharded fit: new owners would lose it.
    TRAINLOOP_CHECK(!zero_ || zero_->layout().same_parameters(optimizer), "the optimizer's parameters changed since "
                    "the last sharded fit, and each rank holds only the state of its share of the old ones; expected "
                    "the same parameter groups in every sharded fit of this loop (or a checkpoint written before the "
                    "change, which holds the whole state, resumed by a new loop)");
    if (group_->world_size() == 1) return;  // one rank: nothing to shard, trains as gpu_mode::Single
    const distributed::UnitAssignment units = distributed::assign_units(*module_, mode_.sharding_units());
    sharded_model_.check(*module_, level);
    distributed::check_trainable_parameters_in(*module_, optimizer, level);
    make_layout(optimizer, units);
    layout_from_load_ = false;  // a fit uses it now: its pieces hold this rank's state from here on
    zero_->keep_own_share(optimizer);  // before the units exist: end_fit puts nothing back if this throws
    gradients_.emplace(layout_, *group_);
    if (level == distributed::Sharding::Full) parameters_.emplace(layout_, *group_, own_chunks_);
  }
  /// Each parameter its own tensor again, whole (a collective, unless the fit is ending with an
  /// exception: the other ranks may not be listening; UnitParameters::release says what is lost),
  /// and this fit's gradient hooks removed. The optimizer's share stays until the next fit: a
  /// checkpoint saved now still gathers it.
  void end_fit() noexcept {
    if (parameters_ && !mode_.whole_model_after_fit() && std::uncaught_exceptions() == 0) {
      parameters_->free_all();  // each rank keeps its chunks, and evaluates unit by unit after the fit
      gradients_.reset();
      this->leave_fit();
      return;
    }
    if (parameters_) {
      const bool communicate = std::uncaught_exceptions() == 0;
      try {
        parameters_->release(communicate);
      } catch (...) {
        try {
          parameters_->release(false);
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
    if (parameters_) parameters_->begin_micro_batch();
    struct FreeUnits {  // also when the step throws
      distributed::UnitParameters* parameters;
      ~FreeUnits() {
        if (parameters) parameters->free_all();
      }
    } free_units{parameters_ ? &*parameters_ : nullptr};
    std::optional<distributed::UnitGatherScope> gathering;
    if (parameters_) gathering.emplace(*parameters_);
    StepOutput out = forward(*module_, batch_to_device(batch, this->device_));
    (loss_scale == 1.0 ? out.loss : out.loss * loss_scale).backward();
    gathering.reset();
    sink(out);
  }
  /// A batch evaluated without gradients. At full inside a fit: as a training micro-batch's
  /// forward (units gathered by the operators that read them, all freed after; one gathered whole
  /// for a callback or a checkpoint is resharded first, keeping what changed in it), so every rank
  /// must evaluate as many batches (evaluates_in_lockstep).
  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    if (!parameters_) {
      Base::eval_batch(batch, std::forward<Forward>(forward), std::forward<Sink>(sink));
      return;
    }
    torch::NoGradGuard no_grad;  // no graph: nothing saved holds a unit, freed as the next is gathered
    parameters_->begin_micro_batch();
    std::optional<StepOutput> out;
    {
      struct FreeUnits {  // also when the forward throws
        distributed::UnitParameters& parameters;
        ~FreeUnits() { parameters.free_all(); }
      } free_units{*parameters_};
      distributed::UnitGatherScope gathering(*parameters_);
      out.emplace(forward(*module_, batch_to_device(batch, this->device_)));
    }
    sink(*out);
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
  }

  // ---- the optimizer step's seams (engine/optimizer_step.hpp) ----
  /// What the step updates: this rank's pieces, their gradients its reduced chunks.
  std::vector<torch::Tensor> stepped_parameters(Module& module) {
    if (!gradients_) return module.parameters();
    return zero_->pieces_with_gradients(gradients_->chunks());
  }
  /// Clipping by the norm over every rank's chunks (a collective).
  void clip_grad_norm(Module& module, double max_norm) {
    if (!gradients_) {
      torch::nn::utils::clip_grad_norm_(module.parameters(), max_norm);
      return;
    }
    distributed::clip_sharded_gradients(zero_->pieces_with_gradients(gradients_->chunks()), max_norm, *group_,
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
    zero_->pieces_with_gradients(gradients_->chunks());  // frozen since the last look: no gradient
    zero_->step_pieces(optimizer);
    if (!parameters_) zero_->broadcast_pieces(*group_);
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
  /// A checkpoint's optimizer part: every rank's share gathered into libtorch's layout on the
  /// writing rank (a collective; distributed/ddp/checkpoint_state.hpp).
  void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive, bool writes) {
    distributed::save_ddp_optimizer_state(group_, zero_ ? &*zero_ : nullptr, nullptr, optimizer, archive, writes);
  }
  /// Loads a whole state (any mode's checkpoint), of which this rank keeps its share.
  void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    drop_unused_loaded_layout(optimizer);
    distributed::load_ddp_optimizer_state(group_, zero_ ? &*zero_ : nullptr, nullptr, optimizer, archive, this->device_);
  }

  // ---- per-rank checkpoints (engine/checkpoint_shares.hpp) ----
  /// Every rank writes its own share once the parameters are laid out (a fit, or a per-rank
  /// checkpoint loaded); before, the state is whole everywhere and rank 0 writes one archive.
  bool writes_sharded_checkpoint() const { return zero_.has_value() && this->world_size() > 1; }
  /// This rank's pieces of the parameters and of the optimizer state (views, no copy).
  std::vector<TensorShare> checkpoint_shares(Module& module, torch::optim::Optimizer& optimizer) {
    zero_->layout().check_same_parameters(optimizer);  // (inside the write: a failure is agreed)
    if (parameters_) parameters_->sync_own_chunks();  // units a callback holds whole: their values into the chunks
    return distributed::zero_checkpoint_shares(*zero_, module, optimizer, /*values_from_pieces=*/parameters_.has_value());
  }
  /// Resuming from a per-rank checkpoint in a rank: lays the parameters out as the fit will, and
  /// reads only this rank's pieces of the optimizer state (any world size wrote it).
  bool load_optimizer_shares(torch::optim::Optimizer& optimizer, ShareSource& source) {
    if (!this->env_ || this->world_size() == 1) return false;  // the launching process, one rank: whole states
    distributed::ZeroOptimizerShard::check_optimizer(optimizer);
    drop_unused_loaded_layout(optimizer);
    if (!zero_) layout_from_load_ = true;
    make_layout(optimizer, distributed::assign_units(*module_, mode_.sharding_units()));
    zero_->layout().check_same_parameters(optimizer);
    distributed::load_zero_optimizer_shares(*zero_, *module_, optimizer, source);
    return true;
  }

 private:
  /// The layout and this rank's pieces (at full, views of its own chunks), made once: in the
  /// first fit, or when a per-rank checkpoint is loaded before it. The same in every later fit:
  /// the optimizer keys this rank's state by its pieces.
  /// A layout a per-rank checkpoint's load made for other parameters than `optimizer`'s, no fit
  /// used yet (a spawned rank replaying an earlier fit): dropped, the next load or fit lays out anew.
  void drop_unused_loaded_layout(const torch::optim::Optimizer& optimizer) {
    if (!zero_ || !layout_from_load_ || zero_->layout().same_parameters(optimizer)) return;
    zero_.reset();
    layout_.reset();
    own_chunks_.clear();
    layout_from_load_ = false;
  }
  void make_layout(torch::optim::Optimizer& optimizer, const distributed::UnitAssignment& units) {
    if (zero_) return;
    layout_ = std::make_shared<const distributed::FlatLayout>(optimizer, static_cast<int>(this->world_size()), units.unit_of);
    if (mode_.sharding() == distributed::Sharding::Full) {
      const auto& distinct = layout_->distinct();
      for (size_t u = 0; u < layout_->unit_count(); ++u) {
        own_chunks_.push_back(torch::zeros({layout_->unit_chunk(u)}, distinct.empty() ? torch::TensorOptions()
                                                                                      : distinct.front().options()));
      }
    }
    zero_.emplace(layout_, static_cast<int>(this->rank()), own_chunks_);
  }

  std::shared_ptr<const distributed::FlatLayout> layout_;  // made in the first fit
  std::vector<torch::Tensor> own_chunks_;                   // full: this rank's chunk of each unit, kept over fits
  std::optional<distributed::ZeroOptimizerShard> zero_;     // this rank's pieces and their optimizer state
  std::optional<distributed::UnitGradients> gradients_;     // this fit's gradient reduction
  std::optional<distributed::UnitParameters> parameters_;   // this fit's sharded parameters (full)
  distributed::ShardedModelRecord sharded_model_;           // the parameters laid out, checked in later fits
  bool layout_from_load_ = false;                           // made by a checkpoint's load, no fit used it yet
};

}  // namespace detail
}  // namespace trainloop
