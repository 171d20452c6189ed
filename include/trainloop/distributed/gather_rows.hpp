#pragma once
/// @file
/// @brief gather_rows: every rank's tensor of any length, on every rank — a collective built on
/// all_gather (which needs equal shapes): lengths first, rows padded to the longest, cut back.
/// Checkpoints use it for every rank's random streams and partial metric sums.

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainloop::distributed {

/// @brief One row per rank of `local` (same dtype on every rank, any length), on the CPU.
/// @param group anything with `world_size()` and `all_gather(tensor)` (every rank's tensor stacked),
///        such as a mode's engine or a ProcessGroup
/// @param local this rank's values (flattened)
/// A collective: every rank calls it at the same point.
template <class Group>
std::vector<torch::Tensor> gather_rows(Group& group, const torch::Tensor& local) {
  if (group.world_size() == 1) return {local.to(torch::kCPU)};
  auto length = torch::full({1}, local.numel(), torch::kInt64);
  const torch::Tensor lengths = group.all_gather(length).to(torch::kCPU).reshape({-1});
  const int64_t longest = lengths.max().template item<int64_t>();
  torch::Tensor padded = torch::zeros({longest}, local.options().device(torch::kCPU));
  padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}).to(torch::kCPU));
  const torch::Tensor all = group.all_gather(padded).to(torch::kCPU);
  std::vector<torch::Tensor> rows;
  for (int64_t r = 0; r < all.size(0); ++r) {
    rows.push_back(all[r].narrow(0, 0, lengths[r].template item<int64_t>()).clone());
  }
  return rows;
}

}  // namespace trainloop::distributed
