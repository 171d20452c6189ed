#pragma once
// The mode of an example from its command line: --gpu-mode (single | dp | ddp), --device,
// --procs (ddp processes on this machine) and --replicas (dp on the CPU). Shared by the examples
// that choose their mode at run time.

#include <trainloop/trainloop.hpp>

#include <string>
#include <type_traits>
#include <variant>

/// The run-time mode named `name`, set up for `device`.
inline trainloop::gpu_mode::Any example_mode(const std::string& name, const torch::Device& device, int procs, int replicas) {
  trainloop::gpu_mode::Any mode = trainloop::gpu_mode::parse(name);
  std::visit(
      [&](auto& policy) {
        using Policy = std::decay_t<decltype(policy)>;
        if constexpr (std::is_same_v<Policy, trainloop::gpu_mode::Single>) {
          policy.device(device);
        } else if constexpr (std::is_same_v<Policy, trainloop::gpu_mode::DataParallel>) {
          if (device.is_cpu()) policy = trainloop::gpu_mode::DataParallel::cpu_replicas(replicas);
        } else {
          policy.device_type(device.type()).procs_per_node(procs);
        }
      },
      mode.get());
  return mode;
}
