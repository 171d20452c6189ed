#pragma once
/// @file
/// @brief Clipping gradients that are spread over the ranks (FullyShardedDataParallel): each
/// rank holds only its chunks, so the whole gradient's norm is the square root of the sum over
/// ranks of each rank's sum of squares.

#include <trainloop/distributed/comm/process_group.hpp>

#include <torch/torch.h>

#include <cmath>
#include <vector>

namespace trainloop::distributed {

/// @brief Clips `pieces`' gradients (this rank's chunks; padding zero, frozen ones undefined) to a
/// whole-gradient norm of `max_norm`: a collective. The same coefficient as
/// torch::nn::utils::clip_grad_norm_, max_norm / (norm + 1e-6) when below 1; the norm is summed in
/// another order, so clipped steps agree with plain DDP to rounding, not bit for bit.
inline void clip_sharded_gradients(const std::vector<torch::Tensor>& pieces, double max_norm, ProcessGroup& group,
                                   const torch::Device& device) {
  torch::NoGradGuard no_grad;
  torch::Tensor squares = torch::zeros({1}, torch::TensorOptions().dtype(torch::kFloat64).device(device));
  for (const auto& piece : pieces) {
    if (piece.grad().defined()) squares += piece.grad().to(torch::kFloat64).pow(2).sum();
  }
  group.all_reduce_sum(squares);
  const double coefficient = max_norm / (std::sqrt(squares.item<double>()) + 1e-6);
  if (coefficient >= 1.0) return;
  for (const auto& piece : pieces) {
    if (piece.grad().defined()) piece.grad().mul_(coefficient);
  }
}

}  // namespace trainloop::distributed
