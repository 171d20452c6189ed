#pragma once
/// @file
/// @brief pinned_batch: a batch moved into page-locked host memory, so its copy to a CUDA device
/// can be asynchronous (`to(device, non_blocking=true)` from pageable memory is a synchronous copy
/// through a staging buffer; from pinned memory it is queued on the stream and the host goes on).

#include <torch/data/example.h>
#include <torch/types.h>

#include <concepts>
#include <utility>

namespace trainloop::data {

/// @brief A CPU tensor in pinned memory (itself when already pinned, undefined or not on the CPU).
inline torch::Tensor pinned_tensor(const torch::Tensor& t) {
  if (!t.defined() || !t.device().is_cpu() || t.is_pinned()) return t;
  return t.pin_memory();
}

/// @brief `batch` with its tensors in pinned memory: an Example's data and target, or what a
/// custom batch type's own `Batch pin_memory() const` returns; other batch types unchanged.
template <class Batch>
Batch pinned_batch(Batch batch) {
  if constexpr (std::same_as<Batch, torch::data::Example<>>) {
    return {pinned_tensor(batch.data), pinned_tensor(batch.target)};
  } else if constexpr (requires { { batch.pin_memory() } -> std::convertible_to<Batch>; }) {
    return batch.pin_memory();
  } else {
    return batch;
  }
}

}  // namespace trainloop::data
