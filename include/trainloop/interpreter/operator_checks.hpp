#pragma once
/// @file
/// @brief The argument checks some allowed operators' kernels do not make themselves, run before
/// a program's call of them (operator_policy.hpp says which operators a program may call).
///
/// Most ATen kernels check what they index (`index_select`, `gather`, `index`, `scatter` refuse an
/// index out of range); the ones below trust their caller, which in Python is the autograd
/// function or decomposition that made the indices, and in a program from a file is the file.
/// Found by reading their kernels (ATen/native/TensorAdvancedIndexing.cpp's `_unsafe_index`,
/// transformers/attention.cpp's flash attention for the CPU) and by the outside test of issue 50.

#include <trainloop/error.hpp>

#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace trainloop::serialization {

/// @brief Checks a call's arguments (its boxed stack) before the kernel runs.
/// @throws trainloop::CheckpointError saying which argument is wrong and why.
using OperatorArgumentCheck = void (*)(const std::vector<c10::IValue>& stack);

namespace detail {

/// Each defined tensor of `indices` (an index list: entry d indexes dimension d of `self`) holds
/// only valid positions: integers in [-size, size), or a mask of the dimensions' sizes.
inline void check_index_list(const torch::Tensor& self, const c10::IValue& indices, const char* op) {
  const auto list = indices.toOptionalTensorList();
  if (static_cast<int64_t>(list.size()) > self.dim()) {
    throw CheckpointError(trainloop::detail::concat(op, " is given ", list.size(), " indices for a tensor of ",
                                                    self.dim(), " dimensions; expected at most one per dimension"));
  }
  int64_t dim = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const c10::optional<at::Tensor> entry = list.get(i);
    if (!entry || !entry->defined()) {
      ++dim;
      continue;
    }
    const torch::Tensor& index = *entry;
    if (index.scalar_type() == torch::kBool || index.scalar_type() == torch::kByte) {  // a mask covers index.dim() dimensions
      for (int64_t k = 0; k < index.dim(); ++k) {
        if (dim + k >= self.dim() || index.size(k) != self.size(dim + k)) {
          throw CheckpointError(trainloop::detail::concat(op, " is given a mask of shape ", index.sizes(),
                                                          " at dimension ", dim, " of a tensor of shape ", self.sizes(),
                                                          "; expected the mask to match those dimensions"));
        }
      }
      dim += index.dim();
      continue;
    }
    if (!c10::isIntegralType(index.scalar_type(), /*includeBool=*/false)) {
      throw CheckpointError(trainloop::detail::concat(op, " is given an index of ", index.scalar_type(),
                                                      "; expected integers or a mask"));
    }
    const int64_t size = self.size(dim);
    if (index.numel() > 0) {
      const auto [low, high] = torch::aminmax(index);
      const int64_t least = low.item<int64_t>(), most = high.item<int64_t>();
      if (least < -size || most >= size) {
        throw CheckpointError(trainloop::detail::concat(op, " is given indices from ", least, " to ", most,
                                                        " for dimension ", dim, " of size ", size, "; expected [-", size,
                                                        ", ", size, ")"));
      }
    }
    ++dim;
  }
}

/// `_unsafe_index(self, indices)` and `_unsafe_index_put(self, indices, values, accumulate)`:
/// advanced indexing without its bounds checks (what decompositions of upsampling emit).
inline void check_unsafe_index(const std::vector<c10::IValue>& stack) {
  check_index_list(stack.at(0).toTensor(), stack.at(1), "aten::_unsafe_index");
}

/// `_unsafe_masked_index(self, mask, indices, fill)`: the same, where `mask` is true.
inline void check_unsafe_masked_index(const std::vector<c10::IValue>& stack) {
  check_index_list(stack.at(0).toTensor(), stack.at(2), "aten::_unsafe_masked_index");
}

/// `embedding(weight, indices, padding_idx, scale_grad_by_freq, sparse)`: its backward (run by
/// autograd) writes at the indices unchecked, so they must be rows of `weight`; and no sparse
/// gradient.
inline void check_embedding(const std::vector<c10::IValue>& stack) {
  const torch::Tensor& weight = stack.at(0).toTensor();
  const torch::Tensor& indices = stack.at(1).toTensor();
  if (weight.dim() != 2) {
    throw CheckpointError(trainloop::detail::concat("aten::embedding is given a weight of shape ", weight.sizes(),
                                                    "; expected [rows, features]"));
  }
  if (stack.size() > 4 && stack.at(4).isBool() && stack.at(4).toBool()) {
    throw CheckpointError("aten::embedding is given sparse=True; expected dense gradients (sparse kernels "
                          "trust their indices)");
  }
  if (!c10::isIntegralType(indices.scalar_type(), /*includeBool=*/false)) {
    throw CheckpointError(trainloop::detail::concat("aten::embedding is given indices of ", indices.scalar_type(),
                                                    "; expected integers"));
  }
  const int64_t rows = weight.size(0);
  if (stack.size() > 2 && stack.at(2).isInt()) {
    const int64_t padding = stack.at(2).toInt();
    if (padding != -1 && (padding < -rows || padding >= rows)) {
      throw CheckpointError(trainloop::detail::concat("aten::embedding is given padding_idx ", padding, " for ", rows,
                                                      " rows; expected -1 (none) or a row"));
    }
  }
  if (indices.numel() > 0) {
    const auto [low, high] = torch::aminmax(indices);
    const int64_t least = low.item<int64_t>(), most = high.item<int64_t>();
    if (least < 0 || most >= rows) {
      throw CheckpointError(trainloop::detail::concat("aten::embedding is given indices from ", least, " to ", most,
                                                      " for ", rows, " rows; expected [0, ", rows, ")"));
    }
  }
}

/// `_scaled_dot_product_flash_attention_for_cpu(query, key, value, dropout_p, is_causal, *,
/// attn_mask, scale)`: its kernel reads key and value by the query's batch and heads without
/// comparing them (mismatched batches read past them).
inline void check_flash_attention_cpu(const std::vector<c10::IValue>& stack) {
  const torch::Tensor& q = stack.at(0).toTensor();
  const torch::Tensor& k = stack.at(1).toTensor();
  const torch::Tensor& v = stack.at(2).toTensor();
  const bool fits = q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == k.size(0) && q.size(0) == v.size(0) &&
                    q.size(1) == k.size(1) && q.size(1) == v.size(1) && k.size(2) == v.size(2) && q.size(3) == k.size(3);
  if (!fits) {
    throw CheckpointError(trainloop::detail::concat(
        "aten::_scaled_dot_product_flash_attention_for_cpu is given query ", q.sizes(), ", key ", k.sizes(),
        " and value ", v.sizes(), "; expected [batch, heads, length, features] for each, batch and heads equal, key and "
        "value of one length, query and key of one feature size"));
  }
  if (stack.size() > 5 && stack.at(5).isTensor()) {
    const torch::Tensor& mask = stack.at(5).toTensor();
    const int64_t shape[4] = {q.size(0), q.size(1), q.size(2), k.size(2)};
    bool broadcasts = mask.dim() <= 4;
    for (int64_t d = 0; broadcasts && d < mask.dim(); ++d) {
      const int64_t size = mask.size(mask.dim() - 1 - d), want = shape[3 - d];
      broadcasts = size == 1 || size == want;
    }
    if (!broadcasts) {
      throw CheckpointError(trainloop::detail::concat("aten::_scaled_dot_product_flash_attention_for_cpu is given ",
                                                      "a mask of shape ", mask.sizes(), " for scores of shape ",
                                                      c10::IntArrayRef(shape, 4), "; expected a mask that broadcasts to them"));
    }
  }
}

}  // namespace detail

/// @brief The check of `qualified`'s ("aten::name.overload") arguments before its kernel runs, or
/// null when its kernel checks them itself.
inline OperatorArgumentCheck operator_argument_check(const std::string& qualified) {
  if (qualified == "aten::_unsafe_index.Tensor" || qualified == "aten::_unsafe_index_put.default") return &detail::check_unsafe_index;
  if (qualified == "aten::_unsafe_masked_index.default") return &detail::check_unsafe_masked_index;
  if (qualified == "aten::embedding.default") return &detail::check_embedding;
  if (qualified == "aten::_scaled_dot_product_flash_attention_for_cpu.default") return &detail::check_flash_attention_cpu;
  return nullptr;
}

}  // namespace trainloop::serialization
