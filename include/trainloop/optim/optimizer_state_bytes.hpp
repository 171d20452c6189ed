#pragma once
/// @file
/// @brief optimizer_state_bytes(): how many bytes of tensors an optimizer's per-parameter state
/// holds on this process (Adam's two moments, SGD's momentum buffer...). What ZeRO divides by the
/// number of ranks, so the loop reports it (EpochRecord::optimizer_state_bytes).

#include <torch/torch.h>

#include <cstdint>
#include <initializer_list>
#include <sstream>

namespace trainloop {
namespace detail {

inline int64_t tensor_bytes(std::initializer_list<torch::Tensor> tensors) {
  int64_t bytes = 0;
  for (const auto& tensor : tensors) {
    if (tensor.defined()) bytes += tensor.numel() * static_cast<int64_t>(tensor.element_size());
  }
  return bytes;
}

/// The bytes of one parameter's state: read from the fields of libtorch's own state types; for
/// any other type, from the tensors its serialize() writes (a round trip through an archive:
/// slower, but it needs nothing from the type).
inline int64_t param_state_bytes(const torch::optim::OptimizerParamState& state) {
  namespace optim = torch::optim;
  if (const auto* adam = dynamic_cast<const optim::AdamParamState*>(&state)) {
    return tensor_bytes({adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()});
  }
  if (const auto* adamw = dynamic_cast<const optim::AdamWParamState*>(&state)) {
    return tensor_bytes({adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()});
  }
  if (const auto* sgd = dynamic_cast<const optim::SGDParamState*>(&state)) return tensor_bytes({sgd->momentum_buffer()});
  if (const auto* adagrad = dynamic_cast<const optim::AdagradParamState*>(&state)) return tensor_bytes({adagrad->sum()});
  if (const auto* rmsprop = dynamic_cast<const optim::RMSpropParamState*>(&state)) {
    return tensor_bytes({rmsprop->square_avg(), rmsprop->momentum_buffer(), rmsprop->grad_avg()});
  }
  torch::serialize::OutputArchive out;
  state.serialize(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  torch::serialize::InputArchive in;
  const std::string data = bytes.str();
  in.load_from(data.data(), data.size());
  int64_t total = 0;
  for (const auto& key : in.keys()) {
    torch::Tensor value;
    if (in.try_read(key, value)) total += tensor_bytes({value});
  }
  return total;
}

}  // namespace detail

/// @brief Bytes of tensors in `optimizer`'s per-parameter state on this process (0 before its
/// first step). Under ZeRO (gpu_mode::DistributedDataParallel::zero) each rank holds about 1/W of
/// what plain DDP holds.
inline int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& entry : optimizer.state()) bytes += detail::param_state_bytes(*entry.second);
  return bytes;
}

}  // namespace trainloop
