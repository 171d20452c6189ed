#pragma once
/// @file
/// @brief gpu_mode::Single: train on one device (CPU or one CUDA device) in this process.

#include <trainloop/cpu/threads.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/one_process_engine.hpp>
#include <trainloop/error.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <memory>
#include <string>

namespace trainloop {
namespace detail {
template <class Module>
class SingleEngine;
}

namespace gpu_mode {

/// @brief Train on one device: `gpu_mode::Single().device(torch::Device("cuda:0"))`.
struct Single {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "single";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::SingleEngine<Module>;

  Single() = default;
  /// @brief Train on `device`.
  explicit Single(torch::Device device) : device_(device) {}
  /// The device the model and batches are placed on.
  TORCH_ARG(torch::Device, device) = torch::Device(torch::kCPU);
};

}  // namespace gpu_mode

namespace detail {

/// Throws a clear error when a CUDA device is asked for on a build or machine without one.
inline void check_device_available(const torch::Device& device) {
  if (!device.is_cuda()) return;
  TRAINLOOP_CHECK(torch::cuda::is_available(), "device ", device.str(),
                  " was asked for, but CUDA is not available (this libtorch has no CUDA, or no GPU is visible); "
                  "expected a device such as cpu");
  TRAINLOOP_CHECK(!device.has_index() || device.index() < static_cast<int64_t>(trainloop::detail::cuda_device_count()),
                  "device ", device.str(), " does not exist; this machine has ", trainloop::detail::cuda_device_count(),
                  " CUDA device(s)");
}

/// The engine of gpu_mode::Single: everything local, collectives are identities (OneProcessEngine's).
template <class Module>
class SingleEngine : public OneProcessEngine {
 public:
  SingleEngine(const gpu_mode::Single& mode, std::shared_ptr<Module> module)
      : device_(mode.device()), module_(std::move(module)) {
    check_device_available(device_);
  }

  torch::Device device() const { return device_; }

  /// Places the model, and gives this process its share of the cores (cpu/threads.hpp):
  /// a CPU model trains with every usable core and a one-thread OpenBLAS pool by default.
  void prepare() {
    if (device_.is_cpu()) cpu::configure_single_process();
    module_->to(device_);
  }
  void begin_fit(torch::optim::Optimizer&) { prepare(); }

  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool /*synchronize*/,
                         Sink&& sink) {
    StepOutput out = forward(*module_, batch_to_device(batch, device_));
    (loss_scale == 1.0 ? out.loss : out.loss * loss_scale).backward();
    sink(out);
  }

  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    torch::NoGradGuard no_grad;
    sink(forward(*module_, batch_to_device(batch, device_)));
  }

 private:
  torch::Device device_;
  std::shared_ptr<Module> module_;
};

}  // namespace detail
}  // namespace trainloop
