#pragma once
/// @file
/// @brief Every tensor of a module's state: its parameters, then its buffers (running statistics).

#include <torch/torch.h>

#include <vector>

namespace trainloop::detail {

/// The module's parameters, then its buffers, in registration order (shared, not copied).
inline std::vector<torch::Tensor> state_tensors(torch::nn::Module& module) {
  std::vector<torch::Tensor> tensors;
  for (auto& p : module.parameters()) tensors.push_back(p);
  for (auto& b : module.buffers()) tensors.push_back(b);
  return tensors;
}

}  // namespace trainloop::detail
