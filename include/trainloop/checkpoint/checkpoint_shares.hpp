#pragma once
/// @file
/// @brief What a rank writes into and reads from a per-rank checkpoint (torch.distributed.checkpoint's
/// layout, checkpoint/dcp_checkpoint.hpp): TensorShare, a contiguous run of one tensor's elements
/// under its key, and ShareSource, where a rank reads the runs it owns. The keys are Python's
/// (DCP's flattened state_dict): `model.<name>` for a parameter or buffer (its dotted name, as
/// named_parameters() prints it) and `optim.state.<name>.<field>` for its optimizer state
/// (optim/param_state_fields.hpp names the fields; `step` is a 0-d float64 tensor).

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

namespace trainloop {

/// @brief One contiguous run of a tensor's elements that this rank writes into a sharded checkpoint.
struct TensorShare {
  std::string key;            ///< e.g. "model.fc.weight", "optim.state.fc.weight.exp_avg"
  std::vector<int64_t> size;  ///< the whole tensor's sizes (empty for a 0-d step counter)
  int64_t begin = 0;          ///< its first element in the whole tensor, in `memory_order`
  torch::Tensor values;       ///< 1-D: elements [begin, begin + values.numel()); any device
  /// The order the run follows: the tensor's dimensions from outermost to innermost in memory
  /// (a channels_last weight: {0, 2, 3, 1}); empty: row-major. A run in another order is written
  /// as the boxes it covers in that order, each a box of the tensor as DCP stores them.
  std::vector<int64_t> memory_order = {};
};

/// @brief The dimensions of dense `tensor` from outermost to innermost in memory (by decreasing
/// stride, ties in dimension order); empty when that is row-major (a contiguous tensor).
inline std::vector<int64_t> memory_order_of(const torch::Tensor& tensor) {
  if (tensor.is_contiguous()) return {};
  std::vector<int64_t> order(static_cast<size_t>(tensor.dim()));
  for (size_t d = 0; d < order.size(); ++d) order[d] = static_cast<int64_t>(d);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tensor.stride(a) > tensor.stride(b); });
  return order;
}

/// @brief What a rank reads its share of a sharded checkpoint from (checkpoint/dcp_checkpoint.hpp).
class ShareSource {
 public:
  virtual ~ShareSource() = default;
  /// Whether the checkpoint holds `key`.
  virtual bool has(const std::string& key) const = 0;
  /// Elements [begin, end) of `key` in row-major order, 1-D, on the CPU; reads only what overlaps them.
  virtual torch::Tensor read_range(const std::string& key, int64_t begin, int64_t end) = 0;
  /// The whole tensor `key`, in its sizes, on the CPU.
  virtual torch::Tensor read_whole(const std::string& key) = 0;
};

/// @brief `model.<name>` for every parameter of `module` by its TensorImpl (a tied parameter by its
/// first name), the keys of checkpoint shares.
inline std::unordered_map<const void*, std::string> parameter_keys(const torch::nn::Module& module) {
  std::unordered_map<const void*, std::string> keys;
  for (const auto& item : module.named_parameters()) keys.emplace(item.value().unsafeGetTensorImpl(), "model." + item.key());
  return keys;
}

/// @brief `optim.state.<name>.<field>` for the parameter whose key is `parameter_key` (`model.<name>`).
inline std::string state_share_key(const std::string& parameter_key, const std::string& field) {
  return "optim.state." + parameter_key.substr(6) + "." + field;
}

}  // namespace trainloop
