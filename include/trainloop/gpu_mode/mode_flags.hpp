#pragma once
/// @file
/// @brief A mode from command-line style flags: `--gpu-mode single|dp|ddp|fsdp`, `--device`,
/// `--procs` (processes on this machine), `--replicas` (DataParallel replicas on the CPU),
/// `--comm-hook` (how DDP's gradients travel), `--zero` (DDP's optimizer state sharded),
/// `--sharding none|optimizer|gradients|full` (what each rank keeps 1/W of;
/// distributed/zero/sharding.hpp: gradients and full are FullyShardedDataParallel, also when
/// spelled `--gpu-mode ddp --sharding full`), `--elastic` (a lost rank's survivors go on: ddp),
/// `--backend auto|gloo|nccl` (the collectives' library of ddp and fsdp).
///
/// @code
/// trainloop::ModeFlags flags;            // filled by your command-line parser (CLI11, ...)
/// app.add_option("--gpu-mode", flags.gpu_mode);
/// trainloop::TrainLoop loop(..., trainloop::mode_from_flags(flags));
/// @endcode
///
/// Open to a user's mode: `mode_from_flags<gpu_mode::AnyOf<..., MyMode>>(flags)` chooses among
/// those modes, and sets each up with `apply_mode_flags(MyMode&, const ModeFlags&)` when the
/// user declares one beside MyMode (found by argument-dependent lookup); `ModeFlags::extra`
/// carries its own flags.

#include <trainloop/gpu_mode/parse.hpp>

#include <torch/torch.h>

#include <exception>
#include <map>
#include <string>
#include <type_traits>
#include <variant>

namespace trainloop {

/// @brief The flags that choose and set up a gpu mode.
struct ModeFlags {
  std::string gpu_mode = "single";  ///< "single", "dp", "ddp", "fsdp" (or a user's mode's name)
  std::string device = "cpu";       ///< "cpu", "cuda", "cuda:1", ...: the device (single), device type (ddp, fsdp)
  int procs = 2;                    ///< ddp, fsdp: processes on this machine (when trainloop spawns them)
  int replicas = 2;                 ///< dp on the CPU: replicas on worker threads
  std::string comm_hook = "none";   ///< ddp: how gradients travel: none, fp16, bf16, powersgd[:RANK] (comm_hook_named)
  bool zero = false;                ///< ddp: ZeRO-1, the optimizer state sharded over the ranks
  std::string sharding = "none";    ///< none, optimizer (ddp with ZeRO-1), gradients or full (fsdp); fsdp's "none" is full
  bool elastic = false;             ///< ddp, fsdp: survive a lost rank in place (gpu_mode::MultiProcess::elastic)
  int max_replacements = 1;         ///< elastic: replacements started per lost rank's place (MultiProcess::max_replacements)
  std::map<std::string, std::string> extra = {};  ///< a user's mode's own flags, by name (read by its apply_mode_flags)
  /// ddp, fsdp: the collectives' library, "auto" (NCCL on CUDA, Gloo on the CPU), "gloo" or "nccl"
  /// (MultiProcess::backend; elastic training on CUDA devices needs "gloo"). Last, so that positional
  /// initialisers written before it still compile.
  std::string backend = "auto";
};

namespace gpu_mode {

/// @brief The device `flags` name. @throws trainloop::ConfigurationError for a name libtorch cannot parse.
inline torch::Device device_of_flags(const ModeFlags& flags) {
  try {
    return torch::Device(flags.device);
  } catch (const std::exception&) {
    std::throw_with_nested(ConfigurationError(
        ::trainloop::detail::concat("trainloop: device is '", flags.device, "'; expected cpu, cuda or cuda:N")));
  }
}

/// @brief gpu_mode::Single on the flags' device.
inline void apply_mode_flags(Single& mode, const ModeFlags& flags) { mode.device(device_of_flags(flags)); }
/// @brief gpu_mode::DataParallel: `replicas` replicas on the CPU, or every visible GPU.
inline void apply_mode_flags(DataParallel& mode, const ModeFlags& flags) {
  if (device_of_flags(flags).is_cpu()) mode = DataParallel::cpu_replicas(flags.replicas);
}
/// @brief The processes of a multi-process mode: `procs` on the flags' device type.
template <class Mode>
void apply_process_flags(MultiProcess<Mode>& mode, const ModeFlags& flags) {
  mode.device_type(device_of_flags(flags).type()).procs_per_node(flags.procs).elastic(flags.elastic)
      .max_replacements(flags.max_replacements).backend(distributed::backend_named(flags.backend));
}
/// @brief gpu_mode::DistributedDataParallel: processes, comm hook, ZeRO-1.
inline void apply_mode_flags(DistributedDataParallel& mode, const ModeFlags& flags) {
  apply_process_flags(mode, flags);
  mode.comm_hook(distributed::comm_hook_named(flags.comm_hook))
      .zero(flags.zero || distributed::sharding_named(flags.sharding) == distributed::Sharding::Optimizer);
}
/// @brief gpu_mode::FullyShardedDataParallel: processes and level ("none" keeps the default, full).
inline void apply_mode_flags(FullyShardedDataParallel& mode, const ModeFlags& flags) {
  apply_process_flags(mode, flags);
  const distributed::Sharding level = distributed::sharding_named(flags.sharding);
  if (level != distributed::Sharding::None) mode.sharding(level);
}

}  // namespace gpu_mode

/// @brief The mode `flags` name among `AnyMode`'s modes (the built-in ones by default), set up
/// by its apply_mode_flags. `--gpu-mode ddp` with sharding gradients or full is the sharded mode.
/// @throws trainloop::ConfigurationError for an unknown mode or device name (listing the valid
/// modes), and for a comm hook, ZeRO or sharding with a mode that has none.
template <class AnyMode = gpu_mode::Any>
AnyMode mode_from_flags(const ModeFlags& flags) {
  const distributed::Sharding sharding = distributed::sharding_named(flags.sharding);
  const bool sharded = sharding >= distributed::Sharding::Gradients;
  const std::string name = flags.gpu_mode == "ddp" && sharded ? "fsdp" : flags.gpu_mode;
  AnyMode mode = AnyMode::parse(name);
  const std::string described = name == flags.gpu_mode ? "gpu mode '" + name + "'"
                                                         : "gpu mode 'ddp' and sharding " + flags.sharding + " (fsdp)";
  auto require = [&](bool allowed, const char* what, const std::string& value, const char* expected) {
    if (allowed) return;
    throw ConfigurationError(detail::concat("trainloop: ", what, " is '", value, "' with ", described, "; expected ",
                                            expected));
  };
  const bool comm_hook = static_cast<bool>(distributed::comm_hook_named(flags.comm_hook));
  require(!comm_hook || name == "ddp", "comm hook", flags.comm_hook,
          "gpu mode ddp (hooks carry DDP's all-reduced gradients between processes; sharded gradients are "
          "reduce-scattered) or comm hook none");
  require(!flags.zero || name == "ddp" || name == "fsdp", "zero", "on", "gpu mode ddp (ZeRO-1 shards the optimizer "
          "state over DDP's processes; fsdp shards it always) or ZeRO off");
  require(sharding == distributed::Sharding::None || name == "ddp" || name == "fsdp", "sharding", flags.sharding,
          "gpu mode ddp or fsdp (sharding splits the model over their processes) or sharding none");
  require(!flags.elastic || name == "ddp" || name == "fsdp", "elastic", "on", "gpu mode ddp (a lost rank's "
          "survivors regroup; one process, or dp's threads, have no rank to lose) or elastic off");
  require(sharding != distributed::Sharding::Optimizer || name == "ddp", "sharding", flags.sharding,
          "gpu mode ddp for sharding optimizer (ZeRO-1), or gradients or full with fsdp");
  std::visit(
      [&](auto& policy) {
        if constexpr (requires { apply_mode_flags(policy, flags); }) apply_mode_flags(policy, flags);
      },
      mode.get());
  return mode;
}

}  // namespace trainloop
