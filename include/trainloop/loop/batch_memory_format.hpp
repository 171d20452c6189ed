#pragma once
/// @file
/// @brief A batch's inputs in the memory format the model trains in (nn/memory_format.hpp).

#include <trainloop/model_contract.hpp>
#include <trainloop/nn/memory_format.hpp>

namespace trainloop::detail {

/// `batch` with its 4-d inputs in channels-last memory when `channels_last`: for
/// torch::data::Example batches only (a model with its own batch type converts its inputs
/// itself). Otherwise the batch itself (its tensors are shared, not copied).
template <class Batch>
Batch batch_in_memory_format(const Batch& batch, bool channels_last) {
  if constexpr (is_example_batch_v<Batch>) {
    if (channels_last && batch.data.defined() && batch.data.dim() == 4) {
      return Batch{nn::input_in_memory_format(batch.data, true), batch.target};
    }
  }
  return batch;
}

}  // namespace trainloop::detail
