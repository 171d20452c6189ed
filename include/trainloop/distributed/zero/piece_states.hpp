#pragma once
/// @file
/// @brief What ZeRO needs to know of libtorch's optimizers to step and keep pieces of tensors:
/// which optimizers update each element on its own, which state fields hold one value per
/// element, and how a tensor (a parameter, its gradient or a state field) reads as one flat run
/// of elements in the parameter's memory order.
///
/// libtorch's optimizers have no interface for this (their states are plain classes), so it is
/// written here for the five per-element ones: SGD, Adam, AdamW, Adagrad, RMSprop.

#include <trainloop/error.hpp>
#include <trainloop/optim/param_state_fields.hpp>

#include <torch/torch.h>

#include <memory>
#include <vector>

namespace trainloop::distributed::detail {

/// `tensor`'s elements as a 1-D view in memory order (its storage, without autograd).
inline torch::Tensor flat_view(const torch::Tensor& tensor) {
  TRAINLOOP_CHECK(tensor.is_non_overlapping_and_dense(), "ZeRO needs parameters whose elements are one dense "
                  "block of memory; a parameter of sizes ", tensor.sizes(), " has strides ", tensor.strides());
  return tensor.detach().as_strided({tensor.numel()}, {1}, tensor.storage_offset());
}

/// `tensor` (a gradient or a state of `parameter`) flat in the parameter's memory order: a view
/// when it has the parameter's strides, a copy in them otherwise. Reads only the parameter's
/// sizes and strides, never its memory (under full sharding that may be freed, and an operator
/// on it would start a gather).
inline torch::Tensor flat_in_layout_of(const torch::Tensor& tensor, const torch::Tensor& parameter) {
  if (tensor.strides() == parameter.strides() && tensor.is_non_overlapping_and_dense()) return flat_view(tensor);
  return flat_view(torch::empty_strided(parameter.sizes(), parameter.strides(), tensor.options()).copy_(tensor));
}

/// The state tensors of `state` that hold one value per element of their parameter
/// (optim/param_state_fields.hpp names them).
inline std::vector<torch::Tensor*> elementwise_fields(torch::optim::OptimizerParamState& state) {
  std::vector<torch::Tensor*> fields;
  for (auto& named : optim::named_elementwise_fields(state)) fields.push_back(named.second);
  return fields;
}

/// Whether `optimizer` is one whose update is per element (its state fields are known).
inline bool steps_per_element(const torch::optim::Optimizer& optimizer) {
  return optim::has_named_state_fields(optimizer);
}

/// A parameter state of `optimizer`'s type, to deserialize another rank's into.
inline std::unique_ptr<torch::optim::OptimizerParamState> new_param_state(const torch::optim::Optimizer& optimizer) {
  return optim::new_param_state(optimizer);  // ZeroOptimizerShard::check_optimizer admits no other type
}

/// The state of elements [first, first + length) of `parameter`, cut from its whole state
/// (counters copied).
inline std::unique_ptr<torch::optim::OptimizerParamState> slice_state(const torch::optim::OptimizerParamState& whole,
                                                                       const torch::Tensor& parameter, int64_t first,
                                                                       int64_t length) {
  std::unique_ptr<torch::optim::OptimizerParamState> part = whole.clone();
  for (torch::Tensor* field : elementwise_fields(*part)) {
    if (field->defined()) {
      *field = flat_in_layout_of(field->to(parameter.device()), parameter).narrow(0, first, length).clone();
    }
  }
  return part;
}

/// One parameter's whole state from its pieces' states, in flat order (counters from the first),
/// on the CPU (the writer of a checkpoint holds it only while writing).
inline std::unique_ptr<torch::optim::OptimizerParamState> join_states(
    const std::vector<const torch::optim::OptimizerParamState*>& parts, const torch::Tensor& parameter) {
  std::unique_ptr<torch::optim::OptimizerParamState> whole = parts.front()->clone();
  std::vector<torch::Tensor*> fields = elementwise_fields(*whole);
  // Each part's fields, read through a copy of the part (elementwise_fields needs a mutable state).
  std::vector<std::unique_ptr<torch::optim::OptimizerParamState>> copies;
  for (const auto* part : parts) copies.push_back(part->clone());
  for (size_t f = 0; f < fields.size(); ++f) {
    if (!fields[f]->defined()) continue;
    std::vector<torch::Tensor> flat;
    for (auto& copy : copies) flat.push_back(elementwise_fields(*copy)[f]->to(torch::kCPU).reshape({-1}));
    torch::Tensor joined = torch::empty_like(parameter, torch::TensorOptions().device(torch::kCPU));
    flat_view(joined).copy_(torch::cat(flat));
    *fields[f] = joined;
  }
  return whole;
}

}  // namespace trainloop::distributed::detail
