#pragma once
/// @file
/// @brief gather_rows: every rank's tensor of any length, on every rank, through a mode engine's
/// all_gather (which needs equal shapes): lengths first, rows padded to the longest, cut back.
/// The loop uses it for every rank's random streams and partial metric sums; it knows only the
/// engine contract (all_gather, world_size), never a process group.

#include <trainloop/detail/padded_rows.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainloop {

/// @brief One row per rank of `local` (same dtype on every rank, any length), on the CPU.
/// @param engine anything with `world_size()` and `all_gather(tensor)` (every rank's tensor
///        stacked), such as a mode's engine
/// @param local this rank's values (flattened)
/// A collective: every rank calls it at the same point.
template <class Engine>
std::vector<torch::Tensor> gather_rows(Engine& engine, const torch::Tensor& local) {
  if (engine.world_size() == 1) return {local.to(torch::kCPU)};
  const torch::Tensor lengths = engine.all_gather(torch::full({1}, local.numel(), torch::kInt64)).to(torch::kCPU).reshape({-1});
  const torch::Tensor all = engine.all_gather(detail::pad_row(local, lengths.max().template item<int64_t>()));
  return detail::cut_rows(std::vector<torch::Tensor>(all.unbind(0)), lengths);
}

}  // namespace trainloop
