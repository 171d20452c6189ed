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
// Section: c10d collectives and autograd hooks (owner: distributed/process_group.hpp,
// distributed/gradient_reducer.hpp, distributed/backend_factory.hpp). Checked against pytorch v2.x sources
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

/// Base class of a hook that runs after an autograd node (here: a parameter's gradient
/// accumulator) has run. Subclasses override
/// `variable_list operator()(const variable_list& outputs, const variable_list& inputs)`.
using AutogradPostHook = ::torch::autograd::FunctionPostHook;

}  // namespace trainloop::detail
// ===================================================================================================
// End of section: c10d collectives and autograd hooks.
// ===================================================================================================
