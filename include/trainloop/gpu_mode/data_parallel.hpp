#pragma once
/// @file
/// @brief gpu_mode::DataParallel: one process, one persistent replica of the model per device
/// (CUDA devices, or CPU replicas), each batch split across them.

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
template <class Module>
class DataParallelEngine;
}

namespace gpu_mode {

/// @brief Data parallelism inside one process: every device holds a replica of the model, every
/// batch is split across them, gradients are summed, one optimizer step updates the model.
///
/// @code
/// trainloop::TrainLoop<Net, trainloop::gpu_mode::DataParallel> loop(
///     net, train, val, optimizer, criterion, options,
///     trainloop::gpu_mode::DataParallel().devices({torch::Device("cuda:0"), torch::Device("cuda:1")}));
/// // or, on any machine: trainloop::gpu_mode::DataParallel::cpu_replicas(3)
/// @endcode
///
/// **What a step does.** The caller's model is replica 0 on `devices()[0]`: the optimizer, built
/// over its parameters, steps it, and it holds the trained weights after fit(). The other
/// replicas are built once, on the first fit() or evaluate() (cloned when the module derives from
/// `torch::nn::Cloneable<Impl>`, otherwise default-constructed and given the model's parameters
/// and buffers by name). A batch of B samples is cut along dimension 0 into contiguous shards
/// whose sizes differ by at most one (7 over 3 replicas: 3, 2, 2; fewer shards than replicas when
/// B is smaller). Worker r moves shard r to its device and runs forward and backward of
/// `loss_r * n_r / B` on replica r, so after the other replicas' gradients are added into replica
/// 0's the gradient is exactly the full-batch mean gradient, for uneven splits too. After the
/// step replica 0's parameters and buffers are copied into the others. Metrics see every shard's
/// outputs (sums, so they are exact). Replicas follow the model's train()/eval() mode.
///
/// **BatchNorm** (and any layer that computes statistics over the batch). As in PyTorch's
/// `nn.DataParallel`, and unlike single-device training:
///  - in training mode each replica normalises its shard with that shard's own batch mean and
///    variance (there is no cross-replica synchronisation), so the loss and gradients equal those
///    of R separate smaller batches, not of one batch of B;
///  - running statistics (and `num_batches_tracked`) are those of replica 0 only: they are updated
///    from shard 0 of every batch, and replica 0's buffers are copied to the other replicas after
///    every optimizer step (and before a forward whenever replica 0's buffers changed), so the
///    other replicas' updates are discarded. Evaluation therefore uses one consistent set of
///    running statistics on every replica, the ones stored in the caller's model.
///
/// **Threads.** One persistent worker thread per replica. Each worker sets its own intra-op thread
/// count to threads_per_replica() or, when that is 0, to max(1, usable cores / replicas) unless
/// OMP_NUM_THREADS is set (then libtorch's default is kept), so the replicas together use the
/// machine's cores without oversubscribing them. With libtorch's OpenMP backend (Debian's and the
/// pip wheels') the count is per thread: a worker's `at::set_num_threads` does not change the
/// calling thread's count, and the process default seen by threads started later is restored
/// (checked: tests/test_data_parallel.cpp). With the native thread-pool backend the count is
/// process-wide, so it is left alone. OpenBLAS (Debian's BLAS) keeps one process-wide pool that
/// at::set_num_threads does not reach and that concurrent callers busy-wait on; while a batch runs
/// on the replicas it is set to 1 thread (libtorch already splits each replica's work over the
/// replica's threads; see cpu/threads.hpp), and restored after.
///
/// **Requirements.** The criterion and the model's forward are called from several threads at
/// once (on different replicas): they must not mutate shared state (libtorch's loss modules and
/// layers do not). Only registered parameters and buffers are copied between replicas (other
/// member state is not).
///
/// **Random layers** (dropout) draw from their device's generator: one for the CPU, one per CUDA
/// device. With reproducible() (the default), replicas that share a generator (CPU replicas, or
/// several on one CUDA device) run their forward passes one after another in replica order when
/// the model draws random numbers, so two runs with the same seed train the same weights bit for
/// bit, and a resumed run equals an uninterrupted one. Whether it draws is seen on the first
/// training batch of each fit() (a generator whose state its forward changed); a model that
/// draws nothing keeps fully parallel forwards. Backward passes, and replicas on different CUDA
/// devices, always run at once. reproducible(false) runs every forward at once: faster for CPU
/// replicas with dropout, but the masks then depend on thread timing.
/// Batches are `torch::data::Example<>`, or a type with `std::vector<Batch> split(int64_t parts) const`.
///
/// **Errors.** An exception in any replica's forward or backward is rethrown on the calling thread
/// after every worker of that batch has finished, naming the replica and its device: a libtorch
/// error as itself with that context added (so `catch (const c10::OutOfMemoryError&)` works),
/// anything else nested in a trainloop::Error. Workers are joined when the TrainLoop is destroyed, after an exception too.
struct DataParallel {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "dp";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::DataParallelEngine<Module>;
  /// Whether DataParallel can build replicas of `Module` (gpu_mode::AnyOf asks before it builds the engine).
  template <class Module>
  static constexpr bool builds_engine_for = detail::replicable_module_v<Module>;
  /// What DataParallel cannot train, in its words (the error when it is chosen for such a model).
  static constexpr std::string_view cannot_train =
      "gpu mode dp cannot train this model: DataParallel needs a module that derives from torch::nn::Cloneable or is "
      "default-constructible, and batches of torch::data::Example<> or with a split(parts) member; expected one of "
      "those, or mode single/ddp";

  /// @brief Every visible CUDA device, or 2 CPU replicas when CUDA is not available.
  DataParallel() = default;
  /// @brief One replica per entry of `devices` (the model itself is on `devices[0]`).
  explicit DataParallel(std::vector<torch::Device> devices) : devices_(std::move(devices)) {}

  /// @brief `n` replicas on the CPU: data parallelism that runs on any machine.
  /// @throws trainloop::Error when `n` < 1.
  static DataParallel cpu_replicas(int n) {
    TRAINLOOP_CHECK(n >= 1, "cpu_replicas(", n, ") was asked for; expected at least 1 replica");
    return DataParallel(std::vector<torch::Device>(static_cast<size_t>(n), torch::Device(torch::kCPU)));
  }

  /// @brief The default device list: cuda:0 .. cuda:N-1 when CUDA is available, else {cpu, cpu}.
  static std::vector<torch::Device> default_devices() {
    std::vector<torch::Device> devices;
    if (torch::cuda::is_available()) {
      for (size_t i = 0; i < trainloop::detail::cuda_device_count(); ++i)
        devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
    }
    if (devices.empty()) devices.assign(2, torch::Device(torch::kCPU));
    return devices;
  }

  /// One replica per device; devices[0] holds the caller's model. A device may repeat
  /// (`{cpu, cpu, cpu}`, or two replicas on one GPU).
  TORCH_ARG(std::vector<torch::Device>, devices) = default_devices();
  /// Intra-op threads of each replica's worker; 0 chooses max(1, cores / replicas), or keeps
  /// libtorch's default when OMP_NUM_THREADS is set.
  TORCH_ARG(int, threads_per_replica) = 0;
  /// Replicas that share a random generator draw from it in replica order (see "Random layers").
  TORCH_ARG(bool, reproducible) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::Error when the device list is empty, names a CUDA device this
  /// machine does not have, or threads_per_replica is negative.
  void validate() const {
    TRAINLOOP_CHECK(!devices_.empty(), "DataParallel was given an empty device list; expected at least one device, "
                                       "e.g. DataParallel::cpu_replicas(2) or {cuda:0, cuda:1}");
    for (const auto& device : devices_) {
      TRAINLOOP_CHECK(device.is_cpu() || device.is_cuda(), "DataParallel was given device ", device.str(),
                      "; expected cpu or cuda devices");
      detail::check_device_available(device);
    }
    TRAINLOOP_CHECK(threads_per_replica_ >= 0, "threads_per_replica is ", threads_per_replica_,
                    "; expected 0 (automatic) or a positive number");
  }
};

}  // namespace gpu_mode

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
