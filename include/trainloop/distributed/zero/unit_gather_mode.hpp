#pragma once
/// @file
/// @brief How sharded parameters see their use: a dispatcher mode. While a micro-batch trains,
/// the training thread includes one dispatch key in its thread-local key set, and a boxed
/// fallback registered for that key looks at each operator's arguments before redispatching it
/// below the key: when one is a view of a unit whose memory is freed, the unit's owner gathers it
/// first (distributed/zero/unit_parameters.hpp). libtorch's modules have no forward hooks, so an
/// operator is the first place a use is visible; the autograd engine carries the thread's key set
/// into backward (also onto its device threads), so a unit is gathered again when its backward
/// needs its weights. Evaluation inside a fit runs in the same scope under a NoGradGuard: without
/// a graph nothing saved holds a unit, so each is freed as soon as an operator reads another.
///
/// Why a dispatcher mode and not a RecordFunction observer (what trainloop used before): the
/// observer's RecordFunction::inputs() asserts in any build without NDEBUG (the accessor checks a
/// flag only a debug-built libtorch sets), a global observer allowed one sharded fit per process,
/// and an observer cannot throw (libtorch swallows its exceptions, so a failed gather became
/// NaN-filled weights and an error after backward). A fallback is ordinary dispatcher code: it
/// works in every build, its exception leaves the operator that needed the unit, and each
/// process may run any number of sharded fits (units are found by their storage, in a registry
/// of the fits now training).
///
/// The key: libtorch reserves no dispatch key for a C++ library's own mode (Python's modes use
/// the Python keys, whose fallback needs a Python interpreter). TESTING_ONLY_GenericMode is the
/// one mode key libtorch itself registers nothing for (its own tests use it, in their own
/// processes); trainloop registers its fallback for it once per process, and a program that
/// already registered one there gets a clear error when a sharded fit starts.

#include <trainloop/error.hpp>

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// @brief What the gather mode calls before an operator that reads a registered storage: the
/// owner of those storages (a fit's sharded parameters) makes the units whole.
class UnitUser {
 public:
  virtual ~UnitUser() = default;
  /// The unit index of `storage` when it is one of this owner's units, else -1.
  virtual int unit_of_storage(const c10::StorageImpl* storage) const = 0;
  /// Makes exactly the units `touched` whole (a collective), before the operator that reads them.
  virtual void use_units(std::vector<size_t> touched) = 0;
};

namespace detail {

/// The key of the gather mode (this file's comment says why this one).
inline constexpr c10::DispatchKey kUnitGatherKey = c10::DispatchKey::TESTING_ONLY_GenericMode;

/// The owners of the sharded fits training now in this process.
struct UnitUsers {
  std::mutex mutex;
  std::vector<UnitUser*> users;
};
inline UnitUsers& unit_users() {
  static UnitUsers registry;
  return registry;
}

/// The fallback: finds each argument tensor's owner and unit (Tensor, Tensor[] and Tensor?[]
/// arguments), lets each owner gather what its units this operator reads, then runs the operator
/// below the mode. A gather's exception leaves here, through the operator.
inline void unit_gather_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  {
    const size_t arguments = op.schema().arguments().size();
    std::vector<std::pair<UnitUser*, size_t>> touched;
    {
      UnitUsers& registry = unit_users();
      std::lock_guard<std::mutex> lock(registry.mutex);
      auto look = [&](const at::Tensor& tensor) {
        if (!tensor.defined() || !tensor.has_storage()) return;
        const c10::StorageImpl* storage = tensor.storage().unsafeGetStorageImpl();
        for (UnitUser* user : registry.users) {
          const int unit = user->unit_of_storage(storage);
          if (unit < 0) continue;
          const std::pair<UnitUser*, size_t> entry{user, static_cast<size_t>(unit)};
          if (std::find(touched.begin(), touched.end(), entry) == touched.end()) touched.push_back(entry);
        }
      };
      for (auto it = stack->end() - static_cast<std::ptrdiff_t>(arguments); it != stack->end(); ++it) {
        if (it->isTensor()) {
          look(it->toTensor());
        } else if (it->isList()) {
          for (const c10::IValue& element : it->toListRef()) {
            if (element.isTensor()) look(element.toTensor());
          }
        }
      }
    }
    if (!touched.empty()) {
      c10::impl::ExcludeDispatchKeyGuard outside_the_mode(kUnitGatherKey);  // the gather's own operators
      std::sort(touched.begin(), touched.end());
      for (size_t i = 0; i < touched.size();) {
        std::vector<size_t> units;
        size_t j = i;
        for (; j < touched.size() && touched[j].first == touched[i].first; ++j) units.push_back(touched[j].second);
        touched[i].first->use_units(std::move(units));
        i = j;
      }
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kUnitGatherKey), stack);
}

/// Registers the fallback once per process.
/// @throws trainloop::ConfigurationError when the key's fallback is taken (by another library).
inline void register_unit_gather_fallback() {
  static const std::shared_ptr<torch::Library> library = [] {
    try {
      auto registered = std::make_shared<torch::Library>(torch::Library::IMPL, "_", kUnitGatherKey, __FILE__, __LINE__);
      registered->fallback(torch::CppFunction::makeFromBoxedFunction<&unit_gather_fallback>());
      return registered;
    } catch (const std::exception& error) {
      std::throw_with_nested(ConfigurationError(
          std::string("trainloop: sharding full could not register its gather mode on dispatch key "
                      "TESTING_ONLY_GenericMode: ") + error.what() + "; expected no other fallback on that key in "
                      "this process, or sharding gradients"));
    }
  }();
  (void)library;
}

}  // namespace detail

/// @brief While it lives, on this thread (and in the backward it starts): every operator that
/// reads a storage of `user` gathers it first. Registers `user` for the scope's lifetime.
class UnitGatherScope {
 public:
  /// Registers `user` and includes the mode's key in this thread's key set.
  explicit UnitGatherScope(UnitUser& user) : user_(user), include_(detail::kUnitGatherKey) {
    detail::register_unit_gather_fallback();
    detail::UnitUsers& registry = detail::unit_users();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.users.push_back(&user_);
  }
  UnitGatherScope(const UnitGatherScope&) = delete;
  UnitGatherScope& operator=(const UnitGatherScope&) = delete;
  /// Unregisters the user; the key leaves the thread's key set.
  ~UnitGatherScope() {
    detail::UnitUsers& registry = detail::unit_users();
    std::lock_guard<std::mutex> lock(registry.mutex);
    registry.users.erase(std::remove(registry.users.begin(), registry.users.end(), &user_), registry.users.end());
  }

 private:
  UnitUser& user_;
  c10::impl::IncludeDispatchKeyGuard include_;
};

}  // namespace trainloop::distributed
