#pragma once
/// @file
/// @brief The one place that knows which libtorch version we are built against.
///
/// Debian ships libtorch 1.13 (CPU, Gloo); GPU machines use the libtorch inside pip torch 2.x
/// (CUDA, NCCL). Every difference between the two is guarded here, by TORCH_VERSION_MAJOR/MINOR
/// only (Debian's version.h says 1.13.0 for 1.13.1), so the rest of the code never branches on it.

#include <torch/version.h>

/// True when built against libtorch 2.0 or newer.
#define TRAINLOOP_TORCH_2 (TORCH_VERSION_MAJOR >= 2)

// ===================================================================================================
// Section: c10d collectives and autograd hooks (owner: distributed/comm/process_group.hpp,
// distributed/ddp/gradient_reducer.hpp, distributed/comm/backend_factory.hpp). Checked against pytorch v2.x sources
// (torch/csrc/distributed/c10d/{Backend,ProcessGroupGloo,ProcessGroupNCCL,Work}.hpp,
// torch/csrc/autograd/{function_hook,function}.h) and Debian's 1.13 headers.
//
// - Backends: in 1.13 ProcessGroupGloo / ProcessGroupNCCL derive from c10d::ProcessGroup; in 2.x
//   they derive from c10d::Backend, and c10d::ProcessGroup became a dispatching wrapper on which
//   backends are registered. Both bases declare the same virtual collectives (allreduce,
//   broadcast, allgather, barrier) with identical signatures, so we hold the backend object
//   itself through `detail::CollectiveBackend` and never touch the 2.x wrapper.
// - Work: already `c10d::Work` (Work.hpp) in 1.13 and in 2.x; aliased so callers name one type.
// - Gloo options: `Options(timeout)` and `devices` exist in both; 2.x adds a defaulted
//   `bool lazyInit = false` to createDeviceFor*(), so the same calls compile in both.
// - Autograd hooks: `FunctionPostHook::operator()(outputs, inputs)` and
//   `Node::add_post_hook / del_post_hook` are unchanged; 2.x adds virtual `compiled_args` with a
//   default body (only used by torch.compile's compiled autograd), so a plain subclass that
//   overrides operator() compiles against both.
// - Errors: 1.13 throws c10d::TimeoutError / c10d::SocketError (std::runtime_error); 2.x throws
//   c10::DistNetworkError / c10::DistStoreError (c10::Error). Callers catch std::exception.
// - TCPStore connect (no branch needed, handled uniformly in ProcessGroup::create): 1.13 truncates
//   the connect timeout to whole seconds and, on a refused connection, sleeps 1 s or gives up
//   when less than 1 s remains; 2.x retries internally. Clients connect in 1 s attempts.
// ===================================================================================================

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if TRAINLOOP_TORCH_2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

namespace trainloop::detail {

/// The common base of ProcessGroupGloo and ProcessGroupNCCL: what we call collectives on.
#if TRAINLOOP_TORCH_2
using CollectiveBackend = ::c10d::Backend;
#else
using CollectiveBackend = ::c10d::ProcessGroup;
#endif

/// Handle of an asynchronous collective (same type in 1.13 and 2.x, named once here).
using WorkHandle = c10::intrusive_ptr<::c10d::Work>;

/// The owning pointer to an autograd node, as `torch::autograd::impl::grad_accumulator` returns
/// it: `std::shared_ptr<Node>` up to 2.14, `c10::intrusive_ptr<Node>` from 2.15 on (checked
/// against pip torch 2.11.0 and 2.15.0). Taken from the function's own return type, so a holder
/// of accumulators (the DDP reducer, fsdp's unit gradients) names one type in every version.
using AutogradNodePtr = decltype(::torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

/// Base class of a hook that runs after an autograd node (here: a parameter's gradient
/// accumulator) has run. Subclasses override
/// `variable_list operator()(const variable_list& outputs, const variable_list& inputs)`.
using AutogradPostHook = ::torch::autograd::FunctionPostHook;

}  // namespace trainloop::detail
// ===================================================================================================
// End of section: c10d collectives and autograd hooks.
// ===================================================================================================

// ===================================================================================================
// Section: autocast and loss scaling (owner: precision/autocast.hpp, precision/grad_scaler.hpp).
// Checked against Debian's 1.13 ATen/autocast_mode.h and pytorch v2.x's.
//
// - Autocast switches: 1.13 has one pair of functions per device (set_enabled / set_cpu_enabled,
//   set_autocast_gpu_dtype / set_autocast_cpu_dtype); 2.4 made them per device type
//   (set_autocast_enabled(device, on), set_autocast_dtype(device, dtype)) and deprecated the old.
//   Both are thread-local state, which is why the loop switches autocast inside each replica's
//   thread (precision/autocast.hpp).
// - Unscaling: at::_amp_foreach_non_finite_check_and_unscale_ (the op torch.amp.GradScaler uses)
//   has a CUDA kernel in both versions but no CPU kernel in 1.13: gradients on the CPU are
//   checked and unscaled with plain tensor ops, which compute the same values.
// ===================================================================================================

#include <ATen/autocast_mode.h>
#include <ATen/ATen.h>
#include <c10/util/string_utils.h>
#include <torch/cuda.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <type_traits>

/// True when built against libtorch 2.4 or newer (per-device-type autocast functions).
#define TRAINLOOP_TORCH_2_4 (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4))

namespace trainloop::detail {

/// The number of CUDA devices, as a count: libtorch 1.13's torch::cuda::device_count() returns
/// size_t, 2.x's a c10::DeviceIndex (int8: it compares signed and streams as a character).
inline size_t cuda_device_count() { return static_cast<size_t>(torch::cuda::device_count()); }

/// Zeroes `optimizer`'s gradients in place, keeping the tensors: libtorch 1.13's only behaviour;
/// 2.x's zero_grad() sets them to none by default, which would drop gradients kept as views of
/// DDP's buckets every step (distributed/ddp/gradient_reducer.hpp) and allocate them anew in backward.
inline void zero_grad_in_place(torch::optim::Optimizer& optimizer) {
#if TRAINLOOP_TORCH_2
  optimizer.zero_grad(/*set_to_none=*/false);
#else
  optimizer.zero_grad();
#endif
}

/// The key under which libtorch's optimizers keep `parameter`'s state in `state` (the map
/// Optimizer::state() returns): the TensorImpl address, as a pointer printed by
/// c10::guts::to_string in 1.13 (a std::string key); in 2.11 the map is keyed by the address
/// itself (void*; checked by building against pip torch 2.11.0), and an intermediate 2.x printed
/// it as a decimal number.
template <class StateMap>
auto optimizer_state_key(const StateMap& /*state*/, const at::Tensor& parameter) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
#if TRAINLOOP_TORCH_2
    return std::to_string(reinterpret_cast<std::uintptr_t>(parameter.unsafeGetTensorImpl()));
#else
    return c10::guts::to_string(parameter.unsafeGetTensorImpl());
#endif
  } else {
    return static_cast<Key>(parameter.unsafeGetTensorImpl());
  }
}

/// Whether autocast is on for `device` in this thread, and its lower-precision type.
struct AutocastSetting {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
};

/// The autocast setting of `device` (CPU or CUDA) in this thread.
inline AutocastSetting autocast_setting(c10::DeviceType device) {
#if TRAINLOOP_TORCH_2_4
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  if (device == c10::DeviceType::CUDA) return {at::autocast::is_enabled(), at::autocast::get_autocast_gpu_dtype()};
  return {at::autocast::is_cpu_enabled(), at::autocast::get_autocast_cpu_dtype()};
#endif
}

/// Sets the autocast setting of `device` (CPU or CUDA) in this thread.
inline void set_autocast_setting(c10::DeviceType device, const AutocastSetting& setting) {
#if TRAINLOOP_TORCH_2_4
  at::autocast::set_autocast_enabled(device, setting.enabled);
  at::autocast::set_autocast_dtype(device, setting.dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(setting.enabled);
    at::autocast::set_autocast_gpu_dtype(setting.dtype);
  } else {
    at::autocast::set_cpu_enabled(setting.enabled);
    at::autocast::set_autocast_cpu_dtype(setting.dtype);
  }
#endif
}

/// Multiplies every gradient in `grads` by `inv_scale` (a one-element float tensor on their
/// device) and sets `found_inf` (a one-element float tensor) to 1 when any holds an inf or NaN.
inline void amp_unscale_and_check(std::vector<at::Tensor>& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  if (grads.front().is_cuda()) {
    at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
    return;
  }
  for (auto& grad : grads) {
    if (!grad.isfinite().all().item<bool>()) found_inf.fill_(1.0);
    grad.mul_(inv_scale.to(grad.scalar_type()));
  }
}

}  // namespace trainloop::detail
// ===================================================================================================
// End of section: autocast and loss scaling.
// ===================================================================================================
