#pragma once
/// @file
/// @brief The units of FullyShardedDataParallel (FSDP's wrapped modules): which submodule
/// each parameter belongs to, and the checks that the model a sharded fit lays out is the one
/// the optimizer trains and stays the same across fits.

#include <trainloop/distributed/zero/sharding.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// @brief Which parameters belong to which unit: TensorImpl address to unit index, and the units' names.
struct UnitAssignment {
  std::vector<std::string> names;                ///< unit i's submodule ("" for the model's own parameters)
  std::unordered_map<const void*, int> unit_of;  ///< parameter (TensorImpl address) to unit index
};

/// @brief The units of `module`: the submodules `names` names (dotted paths, as named_modules()
/// prints them), or its top-level children when `names` is empty; a parameter belongs to the
/// innermost named unit that holds it, and parameters of no named unit form one more unit.
/// @throws trainloop::ConfigurationError for a name that names no submodule, listing the top-level ones.
inline UnitAssignment assign_units(const torch::nn::Module& module, std::vector<std::string> names) {
  if (names.empty()) {
    for (const auto& child : module.named_children()) names.push_back(child.key());
  }
  const auto modules = module.named_modules("", /*include_self=*/false);
  for (const auto& name : names) {
    if (modules.contains(name)) continue;
    std::string children;
    for (const auto& child : module.named_children()) children += (children.empty() ? "" : ", ") + child.key();
    throw ConfigurationError(::trainloop::detail::concat("trainloop: sharding unit '", name, "' names no submodule of "
                                                         "the model; expected a dotted submodule path such as one of "
                                                         "its children: ", children.empty() ? "(none)" : children));
  }
  UnitAssignment assignment;
  assignment.names = names;
  int rest = -1;  // the unit of parameters no named unit holds, made when the first one appears
  for (const auto& parameter : module.named_parameters(/*recurse=*/true)) {
    int best = -1;
    size_t best_length = 0;
    for (size_t u = 0; u < names.size(); ++u) {
      const std::string prefix = names[u] + ".";
      if (parameter.key().rfind(prefix, 0) == 0 && prefix.size() > best_length) {
        best = static_cast<int>(u);
        best_length = prefix.size();
      }
    }
    if (best < 0) {
      if (rest < 0) {
        rest = static_cast<int>(assignment.names.size());
        assignment.names.emplace_back();
      }
      best = rest;
    }
    assignment.unit_of.emplace(parameter.value().unsafeGetTensorImpl(), best);
  }
  return assignment;
}

/// @brief Every parameter of `module` that requires grad is in `optimizer` (sharded gradients are
/// reduced only for the optimizer's parameters, so another would never get its gradient reduced).
/// @throws trainloop::ConfigurationError naming the first that is not.
inline void check_trainable_parameters_in(const torch::nn::Module& module, const torch::optim::Optimizer& optimizer,
                                          Sharding level) {
  auto in_optimizer = [&optimizer](const torch::Tensor& parameter) {
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& p : group.params()) {
        if (p.is_same(parameter)) return true;
      }
    }
    return false;
  };
  for (const auto& parameter : module.named_parameters()) {
    TRAINLOOP_CHECK(!parameter.value().requires_grad() || in_optimizer(parameter.value()), "parameter '",
                    parameter.key(), "' requires grad but is not in the optimizer; sharding ", sharding_name(level),
                    " reduces only the optimizer's parameters: expected every trainable parameter in the optimizer, "
                    "or the parameter frozen");
  }
}

/// @brief The parameters (names and tensors) a sharded fit laid out: later fits of the same loop
/// (joined ranks keep their layout) must find the same.
class ShardedModelRecord {
 public:
  /// Records `module`'s parameters on the first call; afterwards checks they are the same.
  /// @throws trainloop::ConfigurationError naming the first parameter that changed.
  void check(const torch::nn::Module& module, Sharding level) {
    std::vector<std::pair<std::string, const void*>> now;
    for (const auto& parameter : module.named_parameters()) now.emplace_back(parameter.key(), parameter.value().unsafeGetTensorImpl());
    if (!recorded_) {
      parameters_ = std::move(now);
      recorded_ = true;
      return;
    }
    for (size_t i = 0; i < std::max(now.size(), parameters_.size()); ++i) {
      const std::string was = i < parameters_.size() ? parameters_[i].first : "(none)";
      const std::string is = i < now.size() ? now[i].first : "(none)";
      TRAINLOOP_CHECK(i < now.size() && i < parameters_.size() && now[i] == parameters_[i], "the model's "
                      "parameters changed since the last sharded fit: parameter ", i, " is '", is, "' (a new tensor or "
                      "another name), was '", was, "'; expected the same parameters in every fit with sharding ",
                      sharding_name(level), " (or a new TrainLoop resuming a checkpoint)");
    }
  }

 private:
  bool recorded_ = false;
  std::vector<std::pair<std::string, const void*>> parameters_;
};

}  // namespace trainloop::distributed
