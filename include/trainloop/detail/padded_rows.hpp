#pragma once
/// @file
/// @brief Rows of different lengths through collectives that need equal shapes (all_gather,
/// gather): each rank pads its row to the longest, the receiver cuts every row back. Shared by
/// the engine's gather_rows (engine/gather_rows.hpp) and ProcessGroup::gather_rows_to.

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainloop::detail {

/// `local` flattened onto the CPU, zero-padded to `longest` elements.
inline torch::Tensor pad_row(const torch::Tensor& local, int64_t longest) {
  torch::Tensor padded = torch::zeros({longest}, local.options().device(torch::kCPU));
  padded.narrow(0, 0, local.numel()).copy_(local.reshape({-1}).to(torch::kCPU));
  return padded;
}

/// Each received row cut back to its rank's length (`lengths`: one int64 per rank, on the CPU).
inline std::vector<torch::Tensor> cut_rows(const std::vector<torch::Tensor>& padded, const torch::Tensor& lengths) {
  std::vector<torch::Tensor> rows;
  rows.reserve(padded.size());
  for (std::size_t r = 0; r < padded.size(); ++r) {
    rows.push_back(padded[r].to(torch::kCPU).narrow(0, 0, lengths[static_cast<int64_t>(r)].item<int64_t>()).clone());
  }
  return rows;
}

}  // namespace trainloop::detail
