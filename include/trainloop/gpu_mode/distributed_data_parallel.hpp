#pragma once
/// @file
/// @brief gpu_mode::DistributedDataParallel: one process per device or machine, gradients
/// all-reduced in buckets during backward.
///
/// How a run goes:
/// - In a plain process, fit() becomes the launcher: it saves the model and optimizer, re-executes
///   this program once per local rank (distributed::Launcher), waits, and loads the trained state back,
///   so the caller's model is trained when fit() returns. If a rank fails, the others are killed
///   and fit() throws naming the rank and its error.
/// - In a rank (spawned by us, or started by torchrun, Slurm `srun` or Open MPI `mpirun`), fit()
///   joins the process group, broadcasts rank 0's parameters and buffers, trains its shard of the
///   data with a GradientReducer, and returns on every rank. A rank we spawned ends its process
///   when its fit() is done: the program after fit() runs once, in the launching process.

#include <trainloop/cpu/threads.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/model_sync.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/ddp/checkpoint_state.hpp>
#include <trainloop/distributed/ddp/comm_hook_choice.hpp>
#include <trainloop/distributed/ddp/gradient_reducer.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/launcher.hpp>
#include <trainloop/distributed/spawn/spawn_relay.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/distributed/watch/stall_watchdog.hpp>
#include <trainloop/distributed/zero/sharded_gradient_norm.hpp>
#include <trainloop/distributed/zero/sharded_units.hpp>
#include <trainloop/distributed/zero/sharding.hpp>
#include <trainloop/distributed/zero/units.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optimizer_step.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/history.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

namespace trainloop {
namespace detail {
template <class Module>
class DistributedDataParallelEngine;
}

namespace gpu_mode {

/// @brief Distributed data parallel training, in the style of PyTorch's DDP and `torchrun`:
/// `gpu_mode::DistributedDataParallel().procs_per_node(4)`.
struct DistributedDataParallel {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "ddp";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::DistributedDataParallelEngine<Module>;

  /// Processes started on this node; 0 means one per visible CUDA device, or 2 on a CPU machine.
  TORCH_ARG(int, procs_per_node) = 0;
  /// Number of machines in the job.
  TORCH_ARG(int, nnodes) = 1;
  /// This machine's index in [0, nnodes); node 0 hosts rank 0.
  TORCH_ARG(int, node_rank) = 0;
  /// Host of rank 0's TCPStore: an address every node can reach.
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Port of rank 0's TCPStore; 0 picks a free port (single node only).
  TORCH_ARG(int, master_port) = 0;
  /// Collective backend: Auto picks NCCL for CUDA devices and Gloo for the CPU.
  TORCH_ARG(distributed::Backend, backend) = distributed::Backend::Auto;
  /// Device kind of the ranks: CPU, or CUDA (rank r uses gpus[local r], or cuda:local_rank).
  /// Unset: CUDA when available, else CPU.
  TORCH_ARG(std::optional<torch::DeviceType>, device_type) = std::nullopt;
  /// CUDA devices to use, one per local rank (like `fastai.launch --gpus 0,1`); empty = 0..n-1.
  TORCH_ARG(std::vector<int>, gpus) = {};
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
  /// (distributed/ddp/compression_hooks.hpp) or a user's own GradientCommHook.
  TORCH_ARG(distributed::CommHookFactory, comm_hook) = {};
  /// ZeRO stage 1, the same as sharding(Sharding::Optimizer) (kept for the flag `--zero`).
  TORCH_ARG(bool, zero) = false;
  /// What each rank keeps only 1/W of (distributed/zero/sharding.hpp): none (plain DDP), the
  /// optimizer state (ZeRO-1, distributed/zero/zero_optimizer_shard.hpp), also the reduced
  /// gradients (ZeRO-2) or also the parameters between uses (ZeRO-3, FSDP's FULL_SHARD;
  /// distributed/zero/sharded_units.hpp). Checkpoints hold the whole state and parameters
  /// (gathered on save), so they resume in any mode, level and world size.
  TORCH_ARG(distributed::Sharding, sharding) = distributed::Sharding::None;
  /// Levels gradients and full: the submodules (dotted paths, as named_modules() prints them)
  /// whose parameters are reduced and gathered together, like FSDP's auto-wrap policy; empty:
  /// the model's top-level children. Parameters of no unit form one more unit.
  TORCH_ARG(std::vector<std::string>, sharding_units) = {};
  /// Limit for joining the group and for each collective.
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  /// When a rank that makes no progress is named, and what happens then (distributed/watch/):
  /// by default after 60 s (or 10x the slowest step), ending the job; TRAINLOOP_STALL_LIMIT
  /// (seconds or "off") and TRAINLOOP_STALL_ACTION (fail|report) override it.
  TORCH_ARG(distributed::StallWatchOptions, stall_watch) = {};
  /// Seconds the launcher waits after SIGTERM before SIGKILL when a rank failed.
  TORCH_ARG(std::chrono::milliseconds, kill_grace_period) = std::chrono::seconds(3);
  /// Broadcast rank 0's buffers (BatchNorm running statistics) after every optimizer step.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// Spawn mode: when a rank fails, stop the others and start all ranks again, at most this many
  /// times; the restarted ranks resume from the newest checkpoint of the ModelCheckpoint given to
  /// fit() (from the start of the fit() call when there is none yet).
  TORCH_ARG(int, max_restarts) = 0;

 public:  // TORCH_ARG leaves the section private.
  /// @brief The device type ranks train on, after applying the default.
  torch::DeviceType resolved_device_type() const {
    return device_type_.value_or(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);
  }
  /// @brief Processes per node, after applying the default.
  int resolved_procs_per_node() const {
    if (procs_per_node_ > 0) return procs_per_node_;
    if (!gpus_.empty()) return static_cast<int>(gpus_.size());
    return resolved_device_type() == torch::kCUDA ? static_cast<int>(trainloop::detail::cuda_device_count()) : 2;
  }
  /// @brief The sharding level, after applying zero() (= Sharding::Optimizer at least).
  distributed::Sharding resolved_sharding() const {
    return zero_ && sharding_ < distributed::Sharding::Optimizer ? distributed::Sharding::Optimizer : sharding_;
  }
  /// @brief Throws trainloop::Error naming the first option out of range.
  void validate() const {
    TRAINLOOP_CHECK(procs_per_node_ >= 0, "procs_per_node is ", procs_per_node_, "; expected 0 (automatic) or more");
    TRAINLOOP_CHECK(nnodes_ >= 1, "nnodes is ", nnodes_, "; expected 1 or more");
    TRAINLOOP_CHECK(node_rank_ >= 0 && node_rank_ < nnodes_, "node_rank is ", node_rank_, "; expected 0 <= node_rank < ",
                    nnodes_);
    TRAINLOOP_CHECK(master_port_ >= 0 && master_port_ <= 65535, "master port is ", master_port_,
                    "; expected 0 (pick a free one) or 1..65535");
    TRAINLOOP_CHECK(nnodes_ == 1 || master_port_ != 0, "a job of ", nnodes_,
                    " nodes needs an explicit master port (every node must use the same); got 0");
    TRAINLOOP_CHECK(timeout_.count() > 0, "timeout is ", timeout_.count(),
                    " ms; expected a positive limit for joining the group and for each collective");
    distributed::stall_options_from_environment(stall_watch_).validate(timeout_);
    TRAINLOOP_CHECK(max_restarts_ >= 0, "max_restarts is ", max_restarts_, "; expected 0 or more");
    TRAINLOOP_CHECK(kill_grace_period_.count() >= 0, "kill_grace_period is ", kill_grace_period_.count(),
                    " ms; expected 0 or more");
    TRAINLOOP_CHECK(first_bucket_cap_bytes_ > 0 && bucket_cap_bytes_ > 0, "bucket caps are ", first_bucket_cap_bytes_,
                    " and ", bucket_cap_bytes_, " bytes; expected positive sizes");
    if (!gpus_.empty() && procs_per_node_ > 0)
      TRAINLOOP_CHECK(static_cast<int>(gpus_.size()) == procs_per_node_, "gpus lists ", gpus_.size(),
                      " devices but procs_per_node is ", procs_per_node_, "; expected one GPU per process");
    TRAINLOOP_CHECK(!comm_hook_ || resolved_sharding() < distributed::Sharding::Gradients, "a comm hook is set with "
                    "sharding ", distributed::sharding_name(resolved_sharding()), ", whose gradients are reduce-scattered "
                    "per unit, not all-reduced in buckets; expected no comm hook, or sharding none or optimizer");
    TRAINLOOP_CHECK(resolved_procs_per_node() >= 1, "no CUDA device is visible, so no rank can be started; "
                                                    "expected device_type(torch::kCPU) or a visible GPU");
  }
};

}  // namespace gpu_mode

namespace detail {

/// The engine of gpu_mode::DistributedDataParallel (how a run goes: this file's comment above).
template <class Module>
class DistributedDataParallelEngine {
 public:
  DistributedDataParallelEngine(const gpu_mode::DistributedDataParallel& mode, std::shared_ptr<Module> module)
      : mode_(mode), module_(std::move(module)), env_(distributed::detail::cached_rank_env()) {
    mode_.validate();
    if (env_) {
      device_ = rank_device();
    } else if (auto parameters = module_->parameters(); !parameters.empty()) {
      device_ = parameters.front().device();  // the launching process evaluates where the model is
    }
  }

  /// A rank trainloop's launcher started (its fits train from the caller's checkpoint).
  bool spawned() const { return env_ && env_->source == distributed::RankEnvSource::Trainloop; }

  // ---- the mode interface -------------------------------------------------------------
  bool is_main() const { return rank() == 0; }
  int64_t rank() const { return env_ ? env_->rank : 0; }
  int64_t world_size() const { return env_ ? env_->world_size : 1; }
  torch::Device device() const { return device_; }
  DataShard data_shard() const { return {rank(), world_size()}; }
  void all_reduce_sum(torch::Tensor& tensor) {
    if (group_) group_->all_reduce_sum(tensor);
  }
  torch::Tensor all_gather(const torch::Tensor& tensor) {
    return group_ ? group_->all_gather(tensor) : tensor.unsqueeze(0);
  }
  bool any_rank(bool flag) {
    if (!group_ || group_->world_size() == 1) return flag;  // one rank agrees with itself: no host sync
    auto value = torch::full({1}, flag ? 1.0 : 0.0, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
    group_->all_reduce_max(value);
    return value.item<float>() > 0.5f;
  }
  void barrier() {
    if (group_) group_->barrier();
  }

  /// In a rank: threads, the model on this rank's device, the process group, and — in a rank that
  /// joined (torchrun, srun, mpirun) — every rank holding rank 0's parameters and buffers. Once;
  /// every entry point calls it, so evaluate() before fit() is exact too. A rank we spawned skips
  /// the broadcast: its fit() starts by loading the caller's state from initial.ckpt, the same file
  /// on every rank (what it evaluates before that is a replay nobody sees: the launching process
  /// evaluates the caller's model locally). In the launching process: nothing.
  void prepare() {
    if (!env_ || group_) return;
    cpu::apply_intra_op_threads(cpu::intra_op_threads_for(env_->local_world_size));
    module_->to(device_);
    distributed::ProcessGroupOptions options;
    options.backend = mode_.backend();
    options.device = device_;
    options.timeout = mode_.timeout();
    group_ = &distributed::session_process_group(options);
    // Every launcher's ranks pass here: spawned, torchrun, srun, mpirun.
    distributed::start_stall_watchdog(distributed::detail::session_group().options, *env_, mode_.stall_watch());
    if (!spawned()) {
      distributed::broadcast_module_state(*module_, *group_);  // checks every rank holds the same shapes first
      synced_since_join_ = true;
    }
  }

  /// Makes every rank hold rank 0's state and attaches the gradient hooks for this fit only: one
  /// broadcast per fit in a joined rank (the one prepare() made when this fit joined the group, or
  /// a new one); none in a rank we spawned, which loads the caller's state, "initial.ckpt", as the
  /// loop resumes from it (every rank reads the same file).
  void begin_fit(torch::optim::Optimizer& optimizer) {
    TRAINLOOP_CHECK(env_.has_value(), "the DDP engine trained outside a rank; expected fit() to launch ranks");
    prepare();
    if (!spawned() && !std::exchange(synced_since_join_, false)) distributed::broadcast_module_state(*module_, *group_);
    if (mode_.resolved_sharding() != distributed::Sharding::None) begin_sharded_fit(optimizer);
    // One rank: the local gradient is the average; reducing it copied and "all-reduced" every
    // gradient for nothing (measured on an H100, 1-rank NCCL, MLP 4096x4: 5.05 ms per step vs
    // 4.53 ms without DDP).
    if (group_->world_size() == 1) return;
    buffers_ = module_->buffers();
    if (units_) return;  // sharded gradients are reduced by the units
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
    if (units_) {
      // Each parameter its own tensor again, whole: a collective, unless the fit is ending with
      // an exception (the other ranks may not be listening; ShardedUnits::release says what is lost).
      const bool communicate = std::uncaught_exceptions() == 0;
      try {
        units_->release(communicate);
      } catch (...) {
        try {
          units_->release(false);
        } catch (...) {
        }
      }
      units_.reset();
    }
    reducer_.reset();
    comm_hook_.reset();
    parameters_.clear();
    reduced_flags_.clear();
    buffers_.clear();
  }

  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool synchronize, Sink&& sink) {
    if (reducer_ && trainable_set_changed()) build_reducer();  // frozen or unfrozen since (finetune/freeze.hpp)
    if (reducer_) reducer_->set_sync(synchronize);
    if (units_) units_->begin_micro_batch(synchronize);
    struct EndMicroBatch {  // level 3 frees the units also when the step throws
      distributed::ShardedUnits* units;
      ~EndMicroBatch() {
        if (units) units->end_micro_batch();
      }
    } end{units_ ? &*units_ : nullptr};
    StepOutput out = forward(*module_, batch_to_device(batch, device_));
    (loss_scale == 1.0 ? out.loss : out.loss * loss_scale).backward();
    if (units_) units_->rethrow_gather_error();
    sink(out);
  }
  /// Exact uneven batches (loop/epoch_batch_plan.hpp): this rank has no samples in this
  /// micro-batch, so it runs no forward or backward but still takes part in the reduction when
  /// `synchronize` is true — with the gradient it accumulated earlier in the window, else zeros.
  void train_without_samples(bool synchronize) {
    TRAINLOOP_CHECK(mode_.resolved_sharding() != distributed::Sharding::Full, "exact_uneven_batches gave rank ",
                    rank(), " a micro-batch without samples, and sharding is full: the other ranks gather parameters "
                    "as their operators run, which a rank without samples cannot follow; expected exact_uneven_batches "
                    "off or sharding gradients");
    if (units_) units_->begin_micro_batch(synchronize);  // joins the reduction in finalize()
    if (reducer_ && trainable_set_changed()) build_reducer();
    if (reducer_) reducer_->set_sync(synchronize);
  }
  void before_optimizer_step() {
    if (reducer_) reducer_->finalize();
  }
  /// After finalize() every rank holds the same all-reduced gradients. (With one rank there is no
  /// reducer, and any_rank() costs nothing anyway.)
  bool gradients_agree() const { return reducer_.has_value(); }
  void after_optimizer_step() {
    if (!buffers_.empty() && mode_.broadcast_buffers()) group_->broadcast(buffers_, 0);
  }

  /// The whole optimizer step. Plain DDP and ZeRO-1: the default sequence (engine/optimizer_step.hpp).
  /// Sharded gradients (levels 2 and 3): the same sequence on this rank's pieces, whose gradients
  /// are its reduced chunks: fp16 unscales them and every rank agrees on a skip, clipping uses the
  /// norm over every rank's chunks, the owners step, and at level 2 broadcast their pieces.
  OptimizerStepResult optimizer_step(const OptimizerStepRequest<Module>& request) {
    if (!units_) return default_optimizer_step(*this, request);
    units_->finalize();
    const std::vector<torch::Tensor>& pieces = zero_->pieces_with_unit_gradients();
    bool overflow = request.scaler != nullptr && request.scaler->unscale(pieces);
    if (request.scaler != nullptr) overflow = any_rank(overflow);
    if (request.clip_grad_norm > 0.0 && !overflow) {
      distributed::clip_sharded_gradients(pieces, request.clip_grad_norm, *group_, device_);
    }
    if (request.before_step) request.before_step();
    OptimizerStepResult result{learning_rate_of(request.optimizer), momentum_of(request.optimizer), overflow};
    if (!overflow) {
      zero_->step_pieces(request.optimizer);
      if (mode_.resolved_sharding() == distributed::Sharding::Gradients) zero_->broadcast_pieces(*group_);
      units_->after_step();
    }
    if (request.scaler != nullptr) request.scaler->update(overflow);
    after_optimizer_step();
    detail::zero_grad_in_place(request.optimizer);  // the whole gradients went with their reduction
    return result;
  }
  /// Level 3: every unit whole on every rank, for evaluation or a checkpoint (a collective).
  void unshard_parameters() {
    if (units_) units_->unshard();
  }

  /// The optimizer step: under ZeRO this rank's share, then every owner's parameters to every
  /// rank (a collective); otherwise the whole step on every rank.
  void step_optimizer(torch::optim::Optimizer& optimizer) {
    if (zero_) {
      zero_->step(optimizer, *group_);
    } else {
      optimizer.step();
    }
  }
  /// Zeroes the gradients keeping their tensors (in libtorch 2.x too, whose default sets them to
  /// none): gradients kept as bucket views stay views.
  void zero_grad(torch::optim::Optimizer& optimizer) { detail::zero_grad_in_place(optimizer); }
  /// A checkpoint's optimizer part in libtorch's layout, plus this fit's comm hook state; a
  /// collective under ZeRO or with a hook (distributed/ddp/checkpoint_state.hpp).
  void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive, bool writes) {
    distributed::save_ddp_optimizer_state(group_, zero_ ? &*zero_ : nullptr, comm_hook_.get(), optimizer, archive, writes);
  }
  /// Loads a whole state (any mode's checkpoint): under ZeRO this rank keeps its share, and this
  /// fit's comm hook gets its rank's state back (distributed/ddp/checkpoint_state.hpp).
  void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    distributed::load_ddp_optimizer_state(group_, zero_ ? &*zero_ : nullptr, comm_hook_.get(), optimizer, archive, device_);
  }

  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    torch::NoGradGuard no_grad;
    sink(forward(*module_, batch_to_device(batch, device_)));
  }


  // ---- fit orchestration (called by TrainLoop::fit around the loop) ---------------------

  /// Runs the loop the way this process's role requires: launch ranks (distributed/spawn/spawn_relay.hpp),
  /// join as a rank (torchrun, Slurm, Open MPI), or, in a rank we spawned, pass or train the
  /// matching fit() call.
  History run_fit(const FitActions& actions, const ResumeSpec& resume) {
    const int fit_index = distributed::detail::next_fit_index();
    if (!env_) {
      distributed::SpawnFitOptions spawn;
      spawn.fit_index = fit_index;
      spawn.max_restarts = mode_.max_restarts();
      return distributed::launch_spawned_fit(actions, launch_options(), spawn);
    }
    if (env_->source != distributed::RankEnvSource::Trainloop) return actions.train(resume);
    return distributed::run_spawned_rank_fit(*env_, fit_index, actions, resume, [this] { barrier(); });
  }

 private:
  /// ZeRO at any level: the layout of the optimizer state over the ranks (made once, the same in
  /// every fit: the optimizer keys this rank's state by its pieces), this rank's share of a whole
  /// state loaded before, and at levels 2 and 3 the units.
  void begin_sharded_fit(torch::optim::Optimizer& optimizer) {
    const distributed::Sharding level = mode_.resolved_sharding();
    distributed::ZeroOptimizerShard::check_optimizer(optimizer);
    // Joined ranks (torchrun...) keep only their share after a ZeRO fit: new owners would lose it.
    TRAINLOOP_CHECK(!zero_ || zero_->same_parameters(optimizer), "the optimizer's parameters changed since the "
                    "last ZeRO fit, and each rank holds only the state of its share of the old ones; expected the "
                    "same parameter groups in every ZeRO fit of this loop (or a checkpoint written before the "
                    "change, which holds the whole state, resumed by a new loop)");
    if (group_->world_size() == 1) return;
    if (level == distributed::Sharding::Optimizer) {
      if (!zero_) zero_.emplace(optimizer, group_->rank(), group_->world_size());
    } else {
      const distributed::UnitAssignment units = distributed::assign_units(*module_, mode_.sharding_units());
      sharded_model_.check(*module_, level);
      distributed::check_trainable_parameters_in(*module_, optimizer, level);
      if (!zero_) {
        zero_.emplace(optimizer, group_->rank(), group_->world_size(), units.unit_of,
                      level == distributed::Sharding::Full ? distributed::ZeroOptimizerShard::PieceHome::OwnShard
                                                           : distributed::ZeroOptimizerShard::PieceHome::Parameters);
      }
      zero_->keep_own_share(optimizer);  // before the units exist: end_fit puts nothing back if this throws
      units_.emplace(*zero_, *group_, level == distributed::Sharding::Full);
      return;
    }
    zero_->keep_own_share(optimizer);  // a whole state loaded before this fit keeps this rank's pieces
  }

  torch::Device rank_device() const {
    if (mode_.resolved_device_type() != torch::kCUDA) return torch::Device(torch::kCPU);
    const int local = env_->local_rank;
    const int index = mode_.gpus().empty() ? local : mode_.gpus().at(static_cast<size_t>(local));
    torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
    check_device_available(device);
    return device;
  }

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

  distributed::LaunchOptions launch_options() const {
    distributed::LaunchOptions options(mode_.resolved_procs_per_node());
    options.nnodes(mode_.nnodes())
        .node_rank(mode_.node_rank())
        .master_addr(mode_.master_addr())
        .master_port(mode_.master_port())
        .grace_period(mode_.kill_grace_period());
    return options;
  }

  gpu_mode::DistributedDataParallel mode_;
  std::shared_ptr<Module> module_;
  const std::optional<distributed::RankEnv>& env_;
  torch::Device device_ = torch::Device(torch::kCPU);
  distributed::ProcessGroup* group_ = nullptr;
  bool synced_since_join_ = false;  // prepare() broadcast rank 0's state and no fit has used that yet
  std::optional<distributed::GradientReducer> reducer_;
  std::shared_ptr<distributed::GradientCommHook> comm_hook_;  // this fit's, kept across reducer rebuilds
  std::vector<torch::Tensor> parameters_;  // listed once per fit; the reducer takes those requiring grad
  std::vector<char> reduced_flags_;        // which of parameters_ the reducer reduces
  std::vector<torch::Tensor> buffers_;     // listed once per fit, broadcast after every step
  std::optional<distributed::ZeroOptimizerShard> zero_;  // owners of the optimizer state, under ZeRO
  std::optional<distributed::ShardedUnits> units_;       // levels 2 and 3, this fit's units
  distributed::ShardedModelRecord sharded_model_;        // levels 2 and 3: the parameters laid out
};

}  // namespace detail
}  // namespace trainloop
