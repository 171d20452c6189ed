#pragma once
/// @file
/// @brief How much of a model is sharded over the ranks (ZeRO's stages, FSDP's strategies):
/// optimizer is `gpu_mode::DistributedDataParallel().zero(true)`; gradients and full are
/// `gpu_mode::FullyShardedDataParallel().sharding(distributed::Sharding::Full)`; `--sharding full`.
///
/// | level     | each rank keeps 1/W of                      | PyTorch FSDP / DeepSpeed     |
/// |-----------|---------------------------------------------|------------------------------|
/// | none      | nothing (plain DDP)                         | NO_SHARD                     |
/// | optimizer | the optimizer state                         | ZeRO stage 1                 |
/// | gradients | the optimizer state and reduced gradients   | SHARD_GRAD_OP / ZeRO stage 2 |
/// | full      | the optimizer state, gradients, parameters  | FULL_SHARD / ZeRO stage 3    |

#include <trainloop/error.hpp>

#include <ostream>
#include <string>

namespace trainloop::distributed {

/// @brief A sharding level (table in distributed/zero/sharding.hpp); ordered: each shards more.
enum class Sharding { None, Optimizer, Gradients, Full };

/// @brief The level's name: "none", "optimizer", "gradients" or "full".
inline const char* sharding_name(Sharding level) {
  switch (level) {
    case Sharding::Optimizer: return "optimizer";
    case Sharding::Gradients: return "gradients";
    case Sharding::Full: return "full";
    default: return "none";
  }
}

/// @brief Writes the level's name.
inline std::ostream& operator<<(std::ostream& out, Sharding level) { return out << sharding_name(level); }

/// @brief The level named `name` (sharding_name's names).
/// @throws trainloop::ConfigurationError naming `name` and the four names.
inline Sharding sharding_named(const std::string& name) {
  for (Sharding level : {Sharding::None, Sharding::Optimizer, Sharding::Gradients, Sharding::Full}) {
    if (name == sharding_name(level)) return level;
  }
  throw ConfigurationError(::trainloop::detail::concat("trainloop: sharding is '", name,
                                                       "'; expected none, optimizer, gradients or full"));
}

}  // namespace trainloop::distributed
