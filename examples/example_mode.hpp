#pragma once
// The mode of an example from its command line: --gpu-mode (single | dp | ddp), --device,
// --procs (ddp processes on this machine), --replicas (dp on the CPU), --comm-hook (how ddp's
// gradients travel) and --zero (ddp's optimizer state sharded), through trainloop::mode_from_flags.

#include <trainloop/trainloop.hpp>

#include <string>

/// The run-time mode named `name`, set up for `device`.
inline trainloop::gpu_mode::Any example_mode(const std::string& name, const torch::Device& device, int procs, int replicas,
                                             const std::string& comm_hook = "none", bool zero = false) {
  return trainloop::mode_from_flags(trainloop::ModeFlags{name, device.str(), procs, replicas, comm_hook, zero});
}
