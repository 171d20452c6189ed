#pragma once
/// @file
/// @brief gpu_mode::DataParallel: one process, one persistent replica of the model per device
/// (CUDA devices, or CPU replicas), each batch split across them. The policy and how the mode
/// behaves: gpu_mode/data_parallel_policy.hpp; here, its engine.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/replicas/batch_split.hpp>
#include <trainloop/detail/blas_threads.hpp>
#include <trainloop/detail/error_context.hpp>
#include <trainloop/replicas/replica_forward_order.hpp>
#include <trainloop/replicas/replica_set.hpp>
#include <trainloop/replicas/worker_pool.hpp>
#include <trainloop/cpu/threads.hpp>
#include <trainloop/error.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/one_process_engine.hpp>
#include <trainloop/gpu_mode/data_parallel_policy.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/model_contract.hpp>

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trainloop {

namespace detail {

/// Intra-op threads each of `replicas` workers sets, or 0 to leave libtorch's choice alone.
inline int data_parallel_threads_per_replica(const gpu_mode::DataParallel& mode, size_t replicas) {
  if (mode.threads_per_replica() > 0) return mode.threads_per_replica();
  if (cpu::omp_num_threads_from_env()) return 0;  // the user's choice wins
  return cpu::intra_op_threads_for(static_cast<int>(replicas));
}

/// The engine of gpu_mode::DataParallel (see the policy's documentation for the behaviour).
template <class Module>
class DataParallelEngine : public OneProcessEngine {
 public:
  /// What this engine cannot train (see engine_supports_v below).
  static constexpr std::string_view cannot_train = gpu_mode::DataParallel::cannot_train;
  DataParallelEngine(const gpu_mode::DataParallel& mode, std::shared_ptr<Module> module)
      : mode_(mode), module_(std::move(module)) {
    mode_.validate();
    for (const auto& device : mode_.devices()) devices_.push_back(with_index(device));
  }

  torch::Device device() const { return devices_[0]; }

  /// Places the model on devices[0] and builds the replicas and workers (once).
  void prepare() { ensure_started(); }
  /// Refreshes the replicas from the model (which may have changed since the last fit()).
  void begin_fit(torch::optim::Optimizer&) {
    ensure_started();
    random_draws_ = RandomDraws::Unknown;  // seen again on this fit's first batch
    replicas_->clear_replica_gradients();
    replicas_->copy_to_replicas(/*only_changed=*/false);
  }

  /// Forward and backward of every shard on its replica, in parallel; then sink(out) per shard, in order.
  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool /*synchronize*/,
                         Sink&& sink) {
    ensure_started();
    const auto shards = split_batch(batch, static_cast<int64_t>(replicas_->size()));
    const double batch_samples = static_cast<double>(batch_size_of(batch));
    std::vector<StepOutput> outputs(shards.size());
    // Random layers: forwards sharing a generator in replica order (see the policy's documentation).
    const bool ordered = mode_.reproducible() && forward_order_->shares_generators() && random_draws_ != RandomDraws::No;
    const bool probing = ordered && random_draws_ == RandomDraws::Unknown;
    std::vector<char> drew(probing ? shards.size() : 0, 0);  // only on a fit's first batch
    if (ordered) forward_order_->begin();
    try {
      run_on_replicas(shards.size(), "training", [&](size_t r) {
        StepOutput out;
        {
          struct Turn {
            ReplicaForwardOrder* order;
            size_t replica;
            ~Turn() {
              if (order != nullptr) order->done(replica);
            }
          } turn{ordered ? &*forward_order_ : nullptr, r};
          if (ordered) forward_order_->wait_turn(r);
          const torch::Tensor before = probing ? generator_state(replicas_->device(r)) : torch::Tensor();
          out = forward(replicas_->replica(r), batch_to_device(shards[r], replicas_->device(r)));
          if (probing) drew[r] = !torch::equal(before, generator_state(replicas_->device(r)));
        }
        // Weighting by the shard's share makes the summed gradient the full batch's mean gradient.
        const double weight = loss_scale * static_cast<double>(batch_size_of(shards[r])) / batch_samples;
        (out.loss * weight).backward();
        outputs[r] = std::move(out);
      });
    } catch (...) {
      replicas_->clear_replica_gradients();  // no half-accumulated gradients leak into a later step
      throw;
    }
    if (probing) {
      random_draws_ = std::any_of(drew.begin(), drew.end(), [](char d) { return d != 0; }) ? RandomDraws::Yes : RandomDraws::No;
    }
    for (const auto& out : outputs) sink(out);
  }

  /// Adds every replica's gradients into the model's.
  void before_optimizer_step() {
    if (replicas_) replicas_->reduce_gradients_into_primary();
  }
  /// Copies the model's new parameters and buffers into the other replicas.
  void after_optimizer_step() {
    if (replicas_) replicas_->copy_to_replicas(/*only_changed=*/false);
  }

  /// Forward without gradients of every shard on its replica; then sink(out) per shard, in order.
  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    ensure_started();
    torch::NoGradGuard no_grad;  // carried into the workers with the rest of this thread's state
    const auto shards = split_batch(batch, static_cast<int64_t>(replicas_->size()));
    std::vector<StepOutput> outputs(shards.size());
    run_on_replicas(shards.size(), "evaluation", [&](size_t r) {
      outputs[r] = forward(replicas_->replica(r), batch_to_device(shards[r], replicas_->device(r)));
    });
    for (const auto& out : outputs) sink(out);
  }

  /// Number of replicas (devices), the model included.
  size_t replica_count() const { return devices_.size(); }

 private:
  // Every replica has its own worker and the caller only waits. Measured on the 2-core
  // development box: running replica 0 on the calling thread would save one hand-off, 2-3 us per
  // batch (an empty 2-replica round trip took 9-12 us instead of 7-10 us), lost in the noise of
  // whole epochs; but replica 0 would then compute with the caller's intra-op thread count.

  /// "cuda" means the current CUDA device; name it, so every worker can select it.
  static torch::Device with_index(const torch::Device& device) {
    if (!device.is_cuda() || device.has_index()) return device;
    return torch::empty({0}, torch::TensorOptions().device(device)).device();
  }

  void ensure_started() {
    if (replicas_) {
      replicas_->copy_to_replicas(/*only_changed=*/true);  // the model may have been changed outside fit()
      return;
    }
    module_->to(devices_[0]);
    replicas_.emplace(module_, devices_);
    forward_order_.emplace(devices_);
    pool_ = std::make_unique<WorkerPool>(devices_.size());
    threads_per_replica_ = data_parallel_threads_per_replica(mode_, devices_.size());
    set_worker_threads();
  }

  /// Gives each worker its share of the cores (see the policy's documentation).
  void set_worker_threads() {
#if AT_PARALLEL_OPENMP
    const int per_replica = threads_per_replica_;
    if (per_replica == 0) return;
    // Reading the count first fixes this thread's own count (libtorch sets it lazily from the
    // process-wide value, which the workers' set_num_threads changes).
    const int caller_threads = at::get_num_threads();
    std::mutex one_at_a_time;
    auto errors = pool_->run(devices_.size(), [&](size_t) {
      std::lock_guard<std::mutex> lock(one_at_a_time);
      at::get_num_threads();  // the worker's lazy initialisation first, or it would undo the next line
      at::set_num_threads(per_replica);
    });
    at::set_num_threads(caller_threads);  // threads started later (loader workers) keep the caller's default
    rethrow_worker_error(errors, "setting its thread count");
#endif
  }

  /// Runs job(r) for r < count on the workers with this thread's autograd/dispatch state and
  /// the replica's device selected; rethrows the first failure once all have finished.
  void run_on_replicas(size_t count, const char* stage, const std::function<void(size_t)>& job) {
    replicas_->follow_training_mode();
    replicas_->copy_to_replicas(/*only_changed=*/true);
    const at::ThreadLocalState caller_state;  // grad mode, inference mode, autocast keys
    // OpenBLAS's one process-wide pool would make concurrent replicas spin for each other's helpers.
    // One BLAS thread per replica: libtorch already splits the work over the replica's threads.
    const ScopedBlasThreads blas_threads(threads_per_replica_ > 0 ? 1 : 0);
    auto errors = pool_->run(count, [&](size_t r) {
      at::ThreadLocalStateGuard same_state(caller_state);
      c10::OptionalDeviceGuard device_guard;
      if (replicas_->device(r).is_cuda()) device_guard.reset_device(replicas_->device(r));
      job(r);
    });
    rethrow_worker_error(errors, stage);
  }

  void rethrow_worker_error(const std::vector<std::exception_ptr>& errors, const char* stage) const {
    std::optional<size_t> first;
    std::string others;
    for (size_t r = 0; r < errors.size(); ++r) {
      if (!errors[r]) continue;
      if (!first) {
        first = r;
      } else {
        others += (others.empty() ? "" : ", ") + std::to_string(r);
      }
    }
    if (!first) return;
    const std::string where = concat("trainloop: DataParallel replica ", *first, " (device ", devices_[*first].str(),
                                     ") failed during ", stage,
                                     others.empty() ? std::string() : concat(" [replica(s) ", others, " failed too]"));
    try {
      std::rethrow_exception(errors[*first]);
    } catch (const c10::Error&) {
      rethrow_with_context(where);  // the replica's own error object: c10::OutOfMemoryError stays catchable
    } catch (const std::exception& error) {
      std::throw_with_nested(Error(concat(where, ": ", error_text(error))));
    } catch (...) {
      throw Error(concat(where, ": an exception that is not a std::exception"));
    }
  }

  gpu_mode::DataParallel mode_;
  std::vector<torch::Device> devices_;
  std::shared_ptr<Module> module_;
  int threads_per_replica_ = 0;  // intra-op threads of each worker; 0: libtorch's default
  std::optional<ReplicaSet<Module>> replicas_;
  std::optional<ReplicaForwardOrder> forward_order_;
  /// Whether the model's forward draws random numbers, seen on the first batch of a fit.
  enum class RandomDraws { Unknown, Yes, No } random_draws_ = RandomDraws::Unknown;
  std::unique_ptr<WorkerPool> pool_;  // declared last: its threads are joined before the replicas go
};

}  // namespace detail
namespace detail {
template <class Module, class Batch>
inline constexpr bool engine_supports_v<DataParallelEngine<Module>, Batch> =
    replicable_module_v<Module> && splittable_batch_v<Batch>;
}  // namespace detail

}  // namespace trainloop
