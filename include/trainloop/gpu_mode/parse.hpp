#pragma once
/// @file
/// @brief Choosing the gpu_mode at run time: `gpu_mode::parse("ddp")`, gpu_mode::Any and
/// gpu_mode::AnyOf<Modes...>.
///
/// `TrainLoop<Model, gpu_mode::Any>` takes a mode chosen at run time (e.g. from `--gpu-mode`).
/// `gpu_mode::Any` is `AnyOf<Single, DataParallel, DistributedDataParallel>`; a mode of your own
/// (a policy type with a `name` and an `engine<Module>` template implementing ModeEngine, in
/// your own file) joins the switch as `AnyOf<Single, DataParallel, DistributedDataParallel, Mine>`
/// and `AnyOf<...>::parse("mine")`, without an edit of trainloop.
/// The choice is dispatched once per fit()/evaluate() call, into the same loop code the
/// compile-time form instantiates for that mode: no per-batch dispatch in either form.

#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/data_parallel.hpp>
#include <trainloop/gpu_mode/distributed_data_parallel.hpp>
#include <trainloop/gpu_mode/fully_sharded_data_parallel.hpp>
#include <trainloop/gpu_mode/single.hpp>

#include <concepts>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

namespace trainloop {
namespace detail {
template <class Module, class... Modes>
class AnyEngine;
}

namespace gpu_mode {

/// @brief One of `Modes`, chosen at run time (the first one by default).
template <class... Modes>
class AnyOf {
 public:
  static_assert(sizeof...(Modes) > 0, "trainloop: gpu_mode::AnyOf needs at least one mode");
  /// The alternatives, in the order parse() tries their names.
  using variant_type = std::variant<Modes...>;
  /// The engine the loop runs: the chosen mode's engine.
  template <class Module>
  using engine = detail::AnyEngine<Module, Modes...>;

  /// @brief The first mode with its default options.
  AnyOf() = default;
  /// @brief The given mode (one of `Modes`).
  template <class Mode>
    requires(std::same_as<std::remove_cvref_t<Mode>, Modes> || ...)
  AnyOf(Mode&& mode) : mode_(std::forward<Mode>(mode)) {}  // NOLINT(google-explicit-constructor)

  /// @brief The chosen mode's policy object, to read or adjust its options.
  variant_type& get() { return mode_; }
  /// @brief The chosen mode's policy object.
  const variant_type& get() const { return mode_; }
  /// @brief The chosen mode's name ("single", "dp", "ddp", or your mode's).
  std::string name() const {
    return std::visit([](const auto& mode) { return std::string(std::decay_t<decltype(mode)>::name); }, mode_);
  }
  /// @brief The names parse() accepts, comma-separated, in order.
  static std::string names() {
    std::string all;
    ((all += (all.empty() ? "" : ", ") + std::string(Modes::name)), ...);
    return all;
  }
  /// @brief The mode named `name`, with default options.
  /// @throws trainloop::ConfigurationError listing the valid names for anything else.
  static AnyOf parse(std::string_view name) {
    std::optional<AnyOf> chosen;
    ((!chosen && name == Modes::name ? (chosen.emplace(Modes()), true) : false), ...);
    if (!chosen) {
      throw ConfigurationError(detail::concat("trainloop: unknown gpu mode '", name, "'; expected one of: ", names()));
    }
    return *chosen;
  }

 private:
  variant_type mode_;
};

/// @brief The built-in modes, chosen at run time.
using Any = AnyOf<Single, DataParallel, DistributedDataParallel, FullyShardedDataParallel>;

/// @brief The built-in mode named `name`, with default options: "single", "dp", "ddp" or "fsdp".
/// @throws trainloop::ConfigurationError listing the valid names for anything else.
inline Any parse(std::string_view name) { return Any::parse(name); }

}  // namespace gpu_mode

namespace detail {

/// Stands in for the engine of `Policy` when it cannot be built for a module type (DataParallel
/// with a module it cannot replicate), so a run-time choice still compiles; choosing it is a
/// run-time error in the policy's own words (`Policy::cannot_train`).
template <class Policy>
struct UnavailableEngine {
  static constexpr std::string_view cannot_train = Policy::cannot_train;
  template <class Module>
  UnavailableEngine(const Policy&, Module&&) {}
};
template <class Policy, class Batch>
inline constexpr bool engine_supports_v<UnavailableEngine<Policy>, Batch> = false;

/// Whether `Policy`'s engine can be built for `Module`: a policy says so with
/// `template <class Module> static constexpr bool builds_engine_for`; true otherwise.
template <class Policy, class Module>
constexpr bool policy_builds_engine() {
  if constexpr (requires { Policy::template builds_engine_for<Module>; }) {
    return Policy::template builds_engine_for<Module>;
  } else {
    return true;
  }
}

/// The engine AnyEngine holds for a policy.
template <class Policy, class Module>
using any_engine_alternative_t = std::conditional_t<policy_builds_engine<Policy, Module>(),
                                                    typename Policy::template engine<Module>, UnavailableEngine<Policy>>;

/// Holds the engine of the mode chosen at run time; the loop visits it once per call.
template <class Module, class... Modes>
class AnyEngine {
 public:
  AnyEngine(const gpu_mode::AnyOf<Modes...>& mode, std::shared_ptr<Module> module) {
    build(mode, module, std::index_sequence_for<Modes...>{});
  }
  /// Calls `f` with the concrete engine.
  template <class F>
  decltype(auto) visit(F&& f) {
    using First = any_engine_alternative_t<std::tuple_element_t<0, std::tuple<Modes...>>, Module>;
    using Result = std::invoke_result_t<F&, First&>;
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
  // Built by index: two modes may share an engine type.
  template <size_t... I>
  void build(const gpu_mode::AnyOf<Modes...>& mode, const std::shared_ptr<Module>& module, std::index_sequence<I...>) {
    ((mode.get().index() == I ? (engine_.template emplace<I + 1>(std::get<I>(mode.get()), module), true) : false), ...);
  }
  // Engines own threads and process groups, so they are built in place and never moved.
  std::variant<std::monostate, any_engine_alternative_t<Modes, Module>...> engine_;
};

}  // namespace detail
}  // namespace trainloop
