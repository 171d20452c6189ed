#pragma once
/// @file
/// @brief Building the collective backend of a process group: Gloo (CPU) or NCCL (CUDA), over
/// the store the ranks met at (rendezvous.hpp).

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef USE_C10D_NCCL
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <cstdlib>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::distributed {

/// The backend `o` asks for, Auto resolved by the device.
/// @throws trainloop::ConfigurationError for NCCL without a CUDA device or without NCCL in libtorch.
inline Backend resolve_backend(const ProcessGroupOptions& o) {
  Backend backend = o.backend;
  if (backend == Backend::Auto) backend = o.device.is_cuda() ? Backend::Nccl : Backend::Gloo;
#ifndef USE_C10D_NCCL
  TRAINLOOP_CHECK(backend != Backend::Nccl, "backend nccl requested (device ", o.device,
                  ") but this libtorch was built without NCCL (USE_C10D_NCCL undefined); expected "
                  "backend gloo with a CPU device, or a CUDA libtorch");
#endif
  TRAINLOOP_CHECK(backend != Backend::Nccl || o.device.is_cuda(), "backend nccl needs a CUDA device; got ",
                  o.device, "; expected cuda:<local rank>, or backend gloo");
  return backend;
}

namespace detail {

inline CommunicationError rendezvous_error(const ProcessGroupOptions& o, const char* backend, const std::exception& error) {
  return CommunicationError(::trainloop::detail::concat(
      "trainloop: the ", backend, " rendezvous of rank ", o.rank, " with ", o.world_size, " ranks through ",
      o.master_addr, ":", o.master_port, " failed (timeout ",
      (o.rendezvous_timeout.count() > 0 ? o.rendezvous_timeout : o.timeout).count(),
      " ms); expected every rank to start with the same world size and master. Details: ", error.what()));
}

/// Gloo refuses to start without a transport device ("No device(s) specified"). Like
/// torch.distributed: GLOO_SOCKET_IFNAME (comma-separated interfaces) wins; otherwise bind to
/// the interface of master_addr when it is one of ours (one machine, or rank 0's machine),
/// else to the address this host's name resolves to (createDefaultDevice, loopback fallback).
inline std::vector<std::shared_ptr<::gloo::transport::Device>> make_gloo_devices(const ProcessGroupOptions& o) {
  using Gloo = ::c10d::ProcessGroupGloo;
  std::vector<std::shared_ptr<::gloo::transport::Device>> devices;
  if (const char* interfaces = std::getenv("GLOO_SOCKET_IFNAME"); interfaces != nullptr && *interfaces != '\0') {
    std::stringstream list(interfaces);
    for (std::string name; std::getline(list, name, ',');) {
      try {
        devices.push_back(Gloo::createDeviceForInterface(name));
      } catch (const std::exception& error) {
        throw ConfigurationError(::trainloop::detail::concat("trainloop: GLOO_SOCKET_IFNAME names interface '", name,
                                                "' that Gloo cannot use; expected an interface of this host "
                                                "(see `ip addr`). Details: ", error.what()));
      }
    }
    return devices;
  }
  try {
    devices.push_back(Gloo::createDeviceForHostname(o.master_addr));
    return devices;
  } catch (const std::exception&) {
    // master_addr is not an address of this machine: fall through to the host's own address.
  }
  try {
    devices.push_back(Gloo::createDefaultDevice());
  } catch (const std::exception& error) {
    throw ConfigurationError(::trainloop::detail::concat(
        "trainloop: Gloo found no network device for rank ", o.rank, " (neither master_addr '", o.master_addr,
        "' nor this host's name resolve to a local address); set GLOO_SOCKET_IFNAME to the interface "
        "to use. Details: ", error.what()));
  }
  return devices;
}

inline c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> make_gloo(
    const ProcessGroupOptions& o, const c10::intrusive_ptr<::c10d::Store>& store) {
  const bool bounded = o.rendezvous_timeout.count() > 0;
  auto options = ::c10d::ProcessGroupGloo::Options::create(bounded ? o.rendezvous_timeout : o.timeout);
  options->devices = make_gloo_devices(o);
  try {
    auto backend = c10::make_intrusive<::c10d::ProcessGroupGloo>(store, o.rank, o.world_size, options);
    if (bounded) backend->setTimeout(o.timeout);  // the collectives' limit, once the rendezvous is over
    return backend;
  } catch (const std::exception& error) {
    throw rendezvous_error(o, "gloo", error);
  }
}

inline c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> make_nccl(
    [[maybe_unused]] const ProcessGroupOptions& o, [[maybe_unused]] const c10::intrusive_ptr<::c10d::Store>& store) {
#ifdef USE_C10D_NCCL
  auto options = ::c10d::ProcessGroupNCCL::Options::create();
  options->timeout = o.timeout;
  try {
    return c10::make_intrusive<::c10d::ProcessGroupNCCL>(store, o.rank, o.world_size, options);
  } catch (const std::exception& error) {
    throw rendezvous_error(o, "nccl", error);
  }
#else
  throw Error("trainloop: NCCL is not compiled into this libtorch");  // resolve_backend() said so already
#endif
}


}  // namespace detail

/// Runs the rendezvous of the backend `backend` with the other ranks through `store`.
/// @throws trainloop::CommunicationError when it fails (a rank missing, another world size).
inline c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> make_backend(
    Backend backend, const ProcessGroupOptions& o, const c10::intrusive_ptr<::c10d::Store>& store) {
  return backend == Backend::Nccl ? detail::make_nccl(o, store) : detail::make_gloo(o, store);
}

}  // namespace trainloop::distributed
