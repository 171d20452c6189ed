#pragma once
/// @file
/// @brief DDP's gradient communication hook chosen by name (`--comm-hook none|fp16|bf16|powersgd[:RANK]`), and
/// the factory type gpu_mode::DistributedDataParallel::comm_hook takes — a user's own hook is one
/// class derived from GradientCommHook and a lambda that makes it.

#include <trainloop/distributed/ddp/compression_hooks.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/distributed/ddp/powersgd_hook.hpp>
#include <trainloop/error.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

namespace trainloop::distributed {

/// Makes a fresh hook for each fit (hooks may keep per-bucket state); empty: plain all-reduce.
using CommHookFactory = std::function<std::shared_ptr<GradientCommHook>()>;

/// The factory of the built-in hook `name`: "none" (an empty factory: fp32 all-reduce), "fp16"
/// (Fp16CompressionHook), "bf16" (Bf16CompressionHook), or "powersgd" / "powersgd:RANK"
/// (PowerSgdHook of rank RANK, default 1, compressing from step 11 on).
/// @throws trainloop::ConfigurationError naming the value and the valid names for anything else,
///         or a PowerSGD rank that is not a number of 1 or more.
inline CommHookFactory comm_hook_named(const std::string& name) {
  if (name == "none") return {};
  if (name == "fp16") return [] { return std::make_shared<Fp16CompressionHook>(); };
  if (name == "bf16") return [] { return std::make_shared<Bf16CompressionHook>(); };
  if (name == "powersgd" || name.rfind("powersgd:", 0) == 0) {
    std::int64_t rank = 1;
    if (name != "powersgd") {
      const std::string digits = name.substr(9);
      const bool number = !digits.empty() && digits.size() < 10 &&
                          digits.find_first_not_of("0123456789") == std::string::npos;
      rank = number ? std::stoll(digits) : 0;
      if (!number) {
        throw ConfigurationError(::trainloop::detail::concat("trainloop: PowerSGD rank is '", digits,
                                                             "'; expected a whole number of 1 or more"));
      }
    }
    const PowerSgdOptions options = PowerSgdOptions().rank(rank);
    PowerSgdHook::validate(options);  // a rank of 0 fails when the flag is read, not in the ranks
    return [options] { return std::make_shared<PowerSgdHook>(options); };
  }
  throw ConfigurationError(::trainloop::detail::concat("trainloop: comm hook is '", name,
                                                       "'; expected none, fp16, bf16, powersgd or powersgd:RANK"));
}

}  // namespace trainloop::distributed
