#pragma once
/// @file
/// @brief loader_for: the BatchLoader the loop reads a dataset with — the options' workers, and
/// pinned batches when the engine computes on a CUDA device (TrainLoopOptions::pin_memory).

#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/options.hpp>

#include <torch/types.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace trainloop::detail {

/// A loader over `indices` of `dataset` for a loop computing on `device`.
template <class Batch>
data::BatchLoader<data::AnyDataset<Batch>> loader_for(const data::AnyDataset<Batch>& dataset,
                                                      std::vector<size_t> indices, int64_t batch_size,
                                                      bool drop_last, const TrainLoopOptions& options,
                                                      const torch::Device& device) {
  return data::BatchLoader<data::AnyDataset<Batch>>(
      std::make_shared<data::AnyDataset<Batch>>(dataset), std::move(indices),
      data::BatchLoaderOptions(static_cast<size_t>(batch_size))
          .num_workers(static_cast<size_t>(options.num_workers()))
          .drop_last(drop_last)
          .pin_memory(options.pin_memory() && device.is_cuda()));
}

}  // namespace trainloop::detail
