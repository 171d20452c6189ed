#pragma once
/// @file
/// @brief gpu_mode::DataParallel, the policy: which devices hold replicas and how many threads
/// each worker uses (its engine: gpu_mode/data_parallel.hpp).

#include <trainloop/cpu/threads.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/replicas/batch_split.hpp>
#include <trainloop/replicas/replica_set.hpp>

#include <torch/torch.h>

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
}  // namespace trainloop
