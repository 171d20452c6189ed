#pragma once
/// @file
/// @brief A mode from command-line style flags: `--gpu-mode single|dp|ddp`, `--device`,
/// `--procs` (DDP processes on this machine), `--replicas` (DataParallel replicas on the CPU),
/// `--comm-hook` (how DDP's gradients travel), `--zero` (DDP's optimizer state sharded),
/// `--sharding none|optimizer|gradients|full` (what DDP shards; distributed/zero/sharding.hpp).
///
/// @code
/// trainloop::ModeFlags flags;            // filled by your command-line parser (CLI11, ...)
/// app.add_option("--gpu-mode", flags.gpu_mode);
/// trainloop::TrainLoop<Net, trainloop::gpu_mode::Any> loop(..., trainloop::mode_from_flags(flags));
/// @endcode

#include <trainloop/gpu_mode/parse.hpp>

#include <torch/torch.h>

#include <string>
#include <type_traits>
#include <variant>

namespace trainloop {

/// @brief The flags that choose and set up a gpu mode.
struct ModeFlags {
  std::string gpu_mode = "single";  ///< "single", "dp" or "ddp"
  std::string device = "cpu";       ///< "cpu", "cuda", "cuda:1", ...: the device (single), device type (ddp)
  int procs = 2;                    ///< ddp: processes on this machine (when trainloop spawns them)
  int replicas = 2;                 ///< dp on the CPU: replicas on worker threads
  std::string comm_hook = "none";   ///< ddp: how gradients travel: none, fp16, bf16, powersgd[:RANK] (comm_hook_named)
  bool zero = false;                ///< ddp: ZeRO-1, the optimizer state sharded over the ranks
  std::string sharding = "none";    ///< ddp: none, optimizer, gradients or full (distributed::sharding_named)
};

/// @brief The mode `flags` name, set up for their device.
/// @throws trainloop::ConfigurationError for an unknown mode or device name (listing the valid modes),
/// and for a comm hook, ZeRO or a sharding level other than none with a mode other than ddp.
inline gpu_mode::Any mode_from_flags(const ModeFlags& flags) {
  gpu_mode::Any mode = gpu_mode::parse(flags.gpu_mode);
  const distributed::CommHookFactory comm_hook = distributed::comm_hook_named(flags.comm_hook);
  if (comm_hook && !std::holds_alternative<gpu_mode::DistributedDataParallel>(mode.get())) {
    throw ConfigurationError(detail::concat("trainloop: comm hook is '", flags.comm_hook, "' with gpu mode '",
                                            flags.gpu_mode, "'; expected gpu mode ddp (hooks carry DDP's gradients "
                                            "between processes) or comm hook none"));
  }
  if (flags.zero && !std::holds_alternative<gpu_mode::DistributedDataParallel>(mode.get())) {
    throw ConfigurationError(detail::concat("trainloop: ZeRO is on with gpu mode '", flags.gpu_mode, "'; expected gpu "
                                            "mode ddp (ZeRO shards the optimizer state over DDP's processes) or "
                                            "ZeRO off"));
  }
  const distributed::Sharding sharding = distributed::sharding_named(flags.sharding);
  if (sharding != distributed::Sharding::None && !std::holds_alternative<gpu_mode::DistributedDataParallel>(mode.get())) {
    throw ConfigurationError(detail::concat("trainloop: sharding is '", flags.sharding, "' with gpu mode '",
                                            flags.gpu_mode, "'; expected gpu mode ddp (sharding splits the model "
                                            "over DDP's processes) or sharding none"));
  }
  torch::Device device(torch::kCPU);
  try {
    device = torch::Device(flags.device);
  } catch (const std::exception&) {
    std::throw_with_nested(ConfigurationError(
        detail::concat("trainloop: device is '", flags.device, "'; expected cpu, cuda or cuda:N")));
  }
  std::visit(
      [&](auto& policy) {
        using Policy = std::decay_t<decltype(policy)>;
        if constexpr (std::is_same_v<Policy, gpu_mode::Single>) {
          policy.device(device);
        } else if constexpr (std::is_same_v<Policy, gpu_mode::DataParallel>) {
          if (device.is_cpu()) policy = gpu_mode::DataParallel::cpu_replicas(flags.replicas);
        } else {
          policy.device_type(device.type()).procs_per_node(flags.procs).comm_hook(comm_hook).zero(flags.zero).sharding(sharding);
        }
      },
      mode.get());
  return mode;
}

}  // namespace trainloop
