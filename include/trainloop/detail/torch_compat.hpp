#pragma once
/// @file
/// @brief The one place that knows which libtorch version we are built against.
///
/// trainloop supports the libtorch of pip torch 2.11.0 to 2.15.0 (CMake refuses others:
/// cmake/trainloopDependencies.cmake). Every difference between those releases is named here,
/// once, so the rest of the code never branches on the version.

#include <torch/version.h>

// ===================================================================================================
// Section: c10d collectives and autograd hooks (owner: distributed/comm/process_group.hpp,
// distributed/ddp/gradient_reducer.hpp, distributed/comm/backend_factory.hpp). Checked against the
// headers of pip torch 2.11.0 and 2.15.0 (torch/csrc/distributed/c10d/{Backend,ProcessGroupGloo,
// ProcessGroupNCCL,Work}.hpp, torch/csrc/autograd/{function_hook,function,variable}.h).
//
// - Backends: ProcessGroupGloo / ProcessGroupNCCL derive from c10d::Backend, and
//   c10d::ProcessGroup is a dispatching wrapper on which backends are registered; we hold the
//   backend object itself through `detail::CollectiveBackend` and never touch the wrapper.
// - Work: `c10d::Work` (Work.hpp), aliased so callers name one type.
// - Autograd nodes: `torch::autograd::impl::grad_accumulator` returns std::shared_ptr<Node> up to
//   2.14 and c10::intrusive_ptr<Node> from 2.15 on: `detail::AutogradNodePtr` is its return type.
//   `FunctionPostHook::operator()(outputs, inputs)` and `Node::add_post_hook / del_post_hook`
//   are unchanged.
// - Errors: c10::DistNetworkError / c10::DistStoreError (c10::Error). Callers catch std::exception.
// ===================================================================================================

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <utility>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace trainloop::detail {

/// The common base of ProcessGroupGloo and ProcessGroupNCCL: what we call collectives on.
using CollectiveBackend = ::c10d::Backend;

/// Handle of an asynchronous collective, named once here.
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
// Checked against pip torch 2.11.0's and 2.15.0's ATen/autocast_mode.h.
//
// - Autocast switches are per device type (set_autocast_enabled(device, on),
//   set_autocast_dtype(device, dtype)), thread-local, which is why the loop switches autocast
//   inside each replica's thread (precision/autocast.hpp).
// - Unscaling: at::_amp_foreach_non_finite_check_and_unscale_ (the op torch.amp.GradScaler uses)
//   has CPU and CUDA kernels.
// ===================================================================================================

#include <ATen/autocast_mode.h>
#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <type_traits>

namespace trainloop::detail {

/// The number of CUDA devices, as a count: torch::cuda::device_count() returns a c10::DeviceIndex
/// (int8: it compares signed and streams as a character).
inline size_t cuda_device_count() { return static_cast<size_t>(torch::cuda::device_count()); }

/// Zeroes `optimizer`'s gradients in place, keeping the tensors: zero_grad() sets them to none by
/// default, which would drop gradients kept as views of DDP's buckets every step
/// (distributed/ddp/gradient_reducer.hpp) and allocate them anew in backward.
inline void zero_grad_in_place(torch::optim::Optimizer& optimizer) { optimizer.zero_grad(/*set_to_none=*/false); }

/// The key under which libtorch's optimizers keep `parameter`'s state in `state` (the map
/// Optimizer::state() returns): the TensorImpl address itself (void*; pip torch 2.11.0 to 2.15.0).
template <class StateMap>
auto optimizer_state_key(const StateMap& /*state*/, const at::Tensor& parameter) {
  using Key = typename StateMap::key_type;
  return static_cast<Key>(parameter.unsafeGetTensorImpl());
}

/// Whether autocast is on for `device` in this thread, and its lower-precision type.
struct AutocastSetting {
  bool enabled = false;
  at::ScalarType dtype = at::kBFloat16;
};

/// The autocast setting of `device` (CPU or CUDA) in this thread.
inline AutocastSetting autocast_setting(c10::DeviceType device) {
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
}

/// Sets the autocast setting of `device` (CPU or CUDA) in this thread.
inline void set_autocast_setting(c10::DeviceType device, const AutocastSetting& setting) {
  at::autocast::set_autocast_enabled(device, setting.enabled);
  at::autocast::set_autocast_dtype(device, setting.dtype);
}

/// Multiplies every gradient in `grads` by `inv_scale` (a one-element float tensor on their
/// device) and sets `found_inf` (a one-element float tensor) to 1 when any holds an inf or NaN.
inline void amp_unscale_and_check(std::vector<at::Tensor>& grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  if (grads.empty()) return;
  at::_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale);
}

}  // namespace trainloop::detail
// ===================================================================================================
// End of section: autocast and loss scaling.
// ===================================================================================================
