#pragma once
/// @file
/// @brief A state_dict in C++: every parameter and buffer of a model by its Python-style name
/// ("layer1.0.bn1.running_mean"), in the order Python's `Module.state_dict()` lists them.

#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

namespace trainloop::interop {

/// @brief A state_dict: (name, tensor) pairs in file or module order. A vector rather than a map
/// because the order is part of what Python wrote and what it reads back.
using StateDict = std::vector<std::pair<std::string, torch::Tensor>>;

namespace detail {
/// Appends `module`'s own parameters, then its own buffers, then each child's, depth first:
/// the order of Python's `Module.state_dict()` (`_save_to_state_dict`, then the children).
inline void append_state(const torch::nn::Module& module, const std::string& prefix, StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    if (item.value().defined()) out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) out.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& child : module.named_children()) append_state(*child.value(), prefix + child.key() + ".", out);
}
}  // namespace detail

/// @brief The model's parameters and buffers by name, as Python's `model.state_dict()` lists
/// them (each module's parameters, then its buffers, then its children's). The tensors are the
/// model's own, not copies: detach or clone them before changing them.
/// @param module the model
/// @return its state_dict
inline StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict state;
  detail::append_state(module, "", state);
  return state;
}

}  // namespace trainloop::interop
