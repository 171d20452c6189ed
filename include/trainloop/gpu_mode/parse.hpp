#pragma once
/// @file
/// @brief Choosing the gpu_mode at run time: `gpu_mode::parse("ddp")` and gpu_mode::Any.
///
/// `TrainLoop<Model, gpu_mode::Any>` takes a mode chosen at run time (e.g. from `--gpu-mode`).
/// The choice is dispatched once per fit()/evaluate() call, into the same loop code the
/// compile-time form instantiates for that mode: no per-batch dispatch in either form.

#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/data_parallel.hpp>
#include <trainloop/gpu_mode/distributed.hpp>
#include <trainloop/gpu_mode/single.hpp>

#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>

namespace trainloop {
namespace detail {
template <class Module>
class AnyEngine;
}

namespace gpu_mode {

/// @brief One of the modes, chosen at run time.
class Any {
 public:
  /// The alternatives, in the order of their names in parse().
  using variant_type = std::variant<Single, DataParallel, DistributedDataParallel>;
  /// The engine the loop runs: the chosen mode's engine.
  template <class Module>
  using engine = detail::AnyEngine<Module>;

  /// @brief Single-device training on the CPU.
  Any() = default;
  /// @brief The given single-device mode.
  Any(Single mode) : mode_(std::move(mode)) {}  // NOLINT(google-explicit-constructor)
  /// @brief The given DataParallel mode.
  Any(DataParallel mode) : mode_(std::move(mode)) {}  // NOLINT(google-explicit-constructor)
  /// @brief The given DistributedDataParallel mode.
  Any(DistributedDataParallel mode) : mode_(std::move(mode)) {}  // NOLINT(google-explicit-constructor)

  /// @brief The chosen mode's policy object, to read or adjust its options.
  variant_type& get() { return mode_; }
  /// @brief The chosen mode's policy object.
  const variant_type& get() const { return mode_; }
  /// @brief "single", "dp" or "ddp".
  std::string name() const {
    return std::visit([](const auto& mode) { return std::string(std::decay_t<decltype(mode)>::name); }, mode_);
  }

 private:
  variant_type mode_;
};

/// @brief The mode named `name`, with default options: "single", "dp" or "ddp".
/// @throws trainloop::Error listing the valid names for anything else.
inline Any parse(std::string_view name) {
  if (name == Single::name) return Single();
  if (name == DataParallel::name) return DataParallel();
  if (name == DistributedDataParallel::name) return DistributedDataParallel();
  throw ConfigurationError(detail::concat("trainloop: unknown gpu mode '", name, "'; expected one of: ", Single::name, ", ",
                             DataParallel::name, ", ", DistributedDataParallel::name));
}

}  // namespace gpu_mode

namespace detail {

/// Stands in for an engine that cannot be built for this module type (DataParallel with a module
/// it cannot replicate), so a run-time choice still compiles; choosing it is a run-time error.
struct UnavailableEngine {
  template <class Policy, class Module>
  UnavailableEngine(const Policy&, Module&&) {}
};
template <class Batch>
inline constexpr bool engine_supports_v<UnavailableEngine, Batch> = false;

/// The engine AnyEngine holds for a policy.
template <class Policy, class Module>
struct any_engine_alternative {
  using type = typename Policy::template engine<Module>;
};
template <class Module>
struct any_engine_alternative<gpu_mode::DataParallel, Module> {
  using type = std::conditional_t<replicable_module_v<Module>, DataParallelEngine<Module>, UnavailableEngine>;
};
template <class Policy, class Module>
using any_engine_alternative_t = typename any_engine_alternative<Policy, Module>::type;

/// Holds the engine of the mode chosen at run time; the loop visits it once per call.
template <class Module>
class AnyEngine {
 public:
  AnyEngine(const gpu_mode::Any& mode, std::shared_ptr<Module> module) {
    std::visit(
        [&](const auto& policy) {
          using Engine = any_engine_alternative_t<std::decay_t<decltype(policy)>, Module>;
          engine_.template emplace<Engine>(policy, std::move(module));
        },
        mode.get());
  }
  /// Calls `f` with the concrete engine.
  template <class F>
  decltype(auto) visit(F&& f) {
    using Result = std::invoke_result_t<F&, SingleEngine<Module>&>;
    return std::visit(
        [&](auto& engine) -> Result {
          if constexpr (std::is_same_v<std::decay_t<decltype(engine)>, std::monostate>) {
            throw Error("trainloop: no gpu mode engine was built");  // the constructor always builds one
          } else {
            return f(engine);
          }
        },
        engine_);
  }

 private:
  // Engines own threads and process groups, so they are built in place and never moved.
  std::variant<std::monostate, SingleEngine<Module>, any_engine_alternative_t<gpu_mode::DataParallel, Module>,
               DistributedEngine<Module>>
      engine_;
};

}  // namespace detail
}  // namespace trainloop
