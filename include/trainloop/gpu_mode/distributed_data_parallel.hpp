#pragma once
/// @file
/// @brief gpu_mode::DistributedDataParallel: one process per device or machine, every rank holding
/// the whole model, gradients all-reduced in buckets during backward (optionally with the
/// optimizer state sharded: ZeRO-1). How a run goes (launch, join, spawned ranks):
/// gpu_mode/rank_engine.hpp. Sharded gradients and parameters are gpu_mode::FullyShardedDataParallel.

#include <trainloop/distributed/ddp/comm_hook_choice.hpp>
#include <trainloop/distributed/ddp/comm_hook_state.hpp>
#include <trainloop/distributed/ddp/gradient_reducer.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/multi_process.hpp>
#include <trainloop/gpu_mode/rank_engine.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace trainloop {
namespace detail {
template <class Module>
class DistributedDataParallelEngine;
}

namespace gpu_mode {

/// @brief Distributed data parallel training, in the style of PyTorch's DDP and `torchrun`:
/// `gpu_mode::DistributedDataParallel().procs_per_node(4)`. The processes, devices and limits are
/// gpu_mode::MultiProcess's settings; these are the gradients'.
struct DistributedDataParallel : MultiProcess<DistributedDataParallel> {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "ddp";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::DistributedDataParallelEngine<Module>;

  /// Cap of the first gradient bucket (small, so communication starts early in backward).
  TORCH_ARG(int64_t, first_bucket_cap_bytes) = int64_t{1} << 20;
  /// Cap of every later gradient bucket.
  TORCH_ARG(int64_t, bucket_cap_bytes) = int64_t{25} << 20;
  /// All-reduce buckets during backward (true) or all after backward (false, for comparison).
  TORCH_ARG(bool, overlap) = true;
  /// Keep gradients as views of the buckets (one copy of the gradients per rank, none copied in
  /// or out; GradientReducerOptions::gradient_as_bucket_view). Off: the copies PyTorch's DDP makes by default.
  TORCH_ARG(bool, gradient_as_bucket_view) = true;
  /// How gradient buckets travel: empty (the default) all-reduces them in their dtype; otherwise
  /// the factory makes each fit's hook — `distributed::comm_hook_named("fp16")` or `"bf16"`
  /// (distributed/ddp/compression_hooks.hpp) or a user's own GradientCommHook. With elastic
  /// training a regrouped fit makes a fresh hook: what it carried (PowerSGD's Q and error feedback)
  /// starts afresh, as in a checkpoint resumed with another world size.
  TORCH_ARG(distributed::CommHookFactory, comm_hook) = {};
  /// ZeRO stage 1 (sharding level "optimizer"): each rank keeps the optimizer state of 1/W of the
  /// flat parameters and steps them (distributed/zero/sharded_state.hpp); gradients are still
  /// all-reduced whole. Checkpoints resume in any mode and world size.
  TORCH_ARG(bool, zero) = false;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::Error naming the first option out of range.
  void validate() const {
    validate_processes();
    TRAINLOOP_CHECK(first_bucket_cap_bytes_ > 0 && bucket_cap_bytes_ > 0, "bucket caps are ", first_bucket_cap_bytes_,
                    " and ", bucket_cap_bytes_, " bytes; expected positive sizes");
  }
};

}  // namespace gpu_mode

namespace detail {

/// The engine of gpu_mode::DistributedDataParallel: the gradient reducer and its comm hook; with
/// zero() its state is sharded (RankEngine's ShardedState, ZeRO-1); everything else is RankEngine's.
template <class Module>
class DistributedDataParallelEngine : public RankEngine<Module, gpu_mode::DistributedDataParallel> {
  using Base = RankEngine<Module, gpu_mode::DistributedDataParallel>;
  using Base::group_;
  using Base::mode_;
  using Base::module_;

 public:
  DistributedDataParallelEngine(const gpu_mode::DistributedDataParallel& mode, std::shared_ptr<Module> module)
      : Base(mode, std::move(module)) {
    if (mode_.zero()) this->sharded_.shard(/*own_chunks=*/false, nullptr);  // ZeRO-1: one flat space
  }

  /// Every rank holding rank 0's state (RankEngine::join_fit), under ZeRO this rank's share of the
  /// state (ShardedState::begin_fit), and this fit's comm hook and gradient reducer attached (for
  /// this fit only).
  void begin_fit(torch::optim::Optimizer& optimizer) {
    this->join_fit();
    this->sharded_.begin_fit(optimizer, group_->world_size(), group_->rank());
    // One rank: the local gradient is the average; reducing it copied and "all-reduced" every
    // gradient for nothing (measured on an H100, 1-rank NCCL, MLP 4096x4: 5.05 ms per step vs
    // 4.53 ms without DDP).
    if (group_->world_size() == 1) return;
    parameters_ = module_->parameters();
    comm_hook_ = mode_.comm_hook() ? mode_.comm_hook()() : nullptr;
    TRAINLOOP_CHECK(!mode_.comm_hook() || comm_hook_, "the comm_hook factory returned no hook; expected a "
                    "GradientCommHook (or no factory for the plain all-reduce)");
    build_reducer();
  }
  /// Removes this fit's gradient hooks: a later fit (of this or another TrainLoop over the same
  /// model) must not find them still reducing. ZeRO's owners stay until the next fit: after a
  /// ZeRO fit each rank's optimizer holds its share, and a checkpoint saved then still gathers it.
  void end_fit() noexcept {
    reducer_.reset();
    comm_hook_.reset();
    parameters_.clear();
    reduced_flags_.clear();
    this->leave_fit();
  }

  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool synchronize, Sink&& sink) {
    train_without_samples(synchronize);  // the reduction set up, as for a rank without samples
    StepOutput out = forward(*module_, batch_to_device(batch, this->device_));
    (loss_scale == 1.0 ? out.loss : out.loss * loss_scale).backward();
    sink(out);
  }
  /// Exact uneven batches (loop/epoch_batch_plan.hpp): this rank has no samples in this
  /// micro-batch, so it runs no forward or backward but still takes part in the reduction when
  /// `synchronize` is true — with the gradient it accumulated earlier in the window, else zeros.
  void train_without_samples(bool synchronize) {
    if (reducer_ && trainable_set_changed()) build_reducer();  // frozen or unfrozen since (finetune/freeze.hpp)
    if (reducer_) reducer_->set_sync(synchronize);
  }
  void before_optimizer_step() {
    if (reducer_) reducer_->finalize();
    this->commit_step();  // elastic training: the reduced step committed (gpu_mode/rank_engine.hpp)
  }
  /// After finalize() every rank holds the same all-reduced gradients. (With one rank there is no
  /// reducer, and any_rank() costs nothing anyway.)
  bool gradients_agree() const { return reducer_.has_value(); }

  /// The optimizer step: under ZeRO this rank's share, then every owner's parameters to every
  /// rank (a collective); otherwise the whole step on every rank.
  void step_optimizer(torch::optim::Optimizer& optimizer) {
    if (!this->sharded_.holds_share()) return void(optimizer.step());
    this->sharded_.shard().step(optimizer, *group_);
  }
  /// A checkpoint's optimizer part (RankEngine's), plus every rank's comm hook state (a
  /// collective with a hook: distributed/ddp/comm_hook_state.hpp).
  void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive, bool writes) {
    Base::save_optimizer_state(optimizer, archive, writes);
    distributed::save_comm_hook_state(group_, comm_hook_.get(), archive, writes);
  }
  /// Loads a whole state (RankEngine's), and this fit's comm hook gets its rank's state back.
  /// (Per-rank checkpoints hold no hook state: a hook starts afresh.)
  void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    Base::load_optimizer_state(optimizer, archive);
    distributed::load_comm_hook_state(group_, comm_hook_.get(), archive, this->device_);
  }

 private:
  /// Which of this fit's parameters require grad now.
  std::vector<char> trainable_flags() const {
    std::vector<char> flags;
    flags.reserve(parameters_.size());
    for (const auto& parameter : parameters_) flags.push_back(parameter.requires_grad() ? 1 : 0);
    return flags;
  }
  /// Whether a parameter was frozen or unfrozen since the reducer was built (checked before every
  /// micro-batch: a flag read per parameter, no allocation).
  bool trainable_set_changed() const {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i].requires_grad() != (reduced_flags_[i] != 0)) return true;
    }
    return false;
  }
  /// (Re)builds the gradient reducer over the parameters that require grad now: a frozen
  /// parameter gets no gradient, so a reducer waiting for it would reduce zeros into a gradient
  /// it never had (which momentum and weight decay then apply). Every rank freezes the same
  /// parameters (the same program runs in each), so the rebuilt buckets agree. A parameter frozen
  /// by hand since the last build loses the local gradient it may still hold.
  void build_reducer() {
    const std::vector<char> flags = trainable_flags();
    for (size_t i = 0; i < parameters_.size() && i < reduced_flags_.size(); ++i) {
      if (reduced_flags_[i] && !flags[i]) parameters_[i].mutable_grad().reset();
    }
    reducer_.reset();  // its hooks go before the new ones attach
    distributed::GradientReducerOptions reducer_options;
    reducer_options.first_bucket_cap_bytes = mode_.first_bucket_cap_bytes();
    reducer_options.bucket_cap_bytes = mode_.bucket_cap_bytes();
    reducer_options.overlap = mode_.overlap();
    reducer_options.gradient_as_bucket_view = mode_.gradient_as_bucket_view();
    reducer_.emplace(parameters_, *group_, reducer_options);
    if (comm_hook_) reducer_->set_comm_hook(comm_hook_);
    reduced_flags_ = flags;
  }

  std::optional<distributed::GradientReducer> reducer_;
  std::shared_ptr<distributed::GradientCommHook> comm_hook_;  // this fit's, kept across reducer rebuilds
  std::vector<torch::Tensor> parameters_;  // listed once per fit; the reducer takes those requiring grad
  std::vector<char> reduced_flags_;        // which of parameters_ the reducer reduces
};

}  // namespace detail
}  // namespace trainloop
