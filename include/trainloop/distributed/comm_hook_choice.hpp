#pragma once
/// @file
/// @brief DDP's gradient communication hook chosen by name (`--comm-hook none|fp16|bf16`), and
/// the factory type gpu_mode::DistributedDataParallel::comm_hook takes — a user's own hook is one
/// class derived from GradientCommHook and a lambda that makes it.

#include <trainloop/distributed/compression_hooks.hpp>
#include <trainloop/distributed/gradient_comm_hook.hpp>
#include <trainloop/error.hpp>

#include <functional>
#include <memory>
#include <string>

namespace trainloop::distributed {

/// Makes a fresh hook for each fit (hooks may keep per-bucket state); empty: plain all-reduce.
using CommHookFactory = std::function<std::shared_ptr<GradientCommHook>()>;

/// The factory of the built-in hook `name`: "none" (an empty factory: fp32 all-reduce), "fp16"
/// (Fp16CompressionHook) or "bf16" (Bf16CompressionHook).
/// @throws trainloop::ConfigurationError naming the value and the valid names for anything else.
inline CommHookFactory comm_hook_named(const std::string& name) {
  if (name == "none") return {};
  if (name == "fp16") return [] { return std::make_shared<Fp16CompressionHook>(); };
  if (name == "bf16") return [] { return std::make_shared<Bf16CompressionHook>(); };
  throw ConfigurationError(::trainloop::detail::concat("trainloop: comm hook is '", name, "'; expected none, fp16 or bf16"));
}

}  // namespace trainloop::distributed
