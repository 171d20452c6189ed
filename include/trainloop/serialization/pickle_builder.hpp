#pragma once
/// @file
/// @brief How serialization/pickle_reader.hpp's unpickler makes values: into one PickleDocument,
/// each text, container and tensor counted against PickleLimits (memory, nesting) as it is made.

#include <trainloop/error.hpp>
#include <trainloop/serialization/pickle_limits.hpp>
#include <trainloop/serialization/pickle_value.hpp>
#include <trainloop/serialization/tensor_rebuild.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string_view>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief Makes the values of one pickle into its PickleDocument, within PickleLimits.
class PickleBuilder {
 public:
  /// @param limits the bounds of this pickle
  explicit PickleBuilder(PickleLimits limits) : limits_(limits) {}

  /// @brief What the pickle used of the limits so far (complete after Unpickler::run()).
  const PickleStats& stats() const { return stats_; }

 protected:
  using Kind = PickleValue::Kind;  ///< the kinds of values

  /// Counts `bytes` of values against PickleLimits::max_value_bytes.
  void charge(size_t bytes) {
    stats_.value_bytes += bytes;
    if (stats_.value_bytes > limits_.max_value_bytes) {
      pickle_fail("the pickle's values need more than ", limits_.max_value_bytes, " bytes; expected a file of weights");
    }
  }
  /// How deep the containers under `value` nest (0 for a value that is no container).
  uint32_t depth_of(const PickleValue& value) const {
    return value.is_container() ? document_.depths_[value.index] : 0;
  }
  /// A new container holding `items`.
  PickleValue make_container(Kind kind, std::vector<PickleValue> items) {
    charge(48 + items.size() * sizeof(PickleValue));
    uint32_t depth = 1;
    for (const auto& item : items) depth = std::max(depth, depth_of(item) + 1);
    check_depth(depth);
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.containers_.size());
    document_.containers_.push_back(std::move(items));
    document_.depths_.push_back(depth);
    return value;
  }
  /// Refuses a nesting deeper than PickleLimits::max_depth.
  void check_depth(uint32_t depth) {
    stats_.depth = std::max(stats_.depth, depth);
    if (depth > limits_.max_depth) pickle_fail("the pickle nests containers ", depth, " deep; expected at most ", limits_.max_depth);
  }
  /// Appends `items` to the container `target` (a list or dict being filled).
  void extend(const PickleValue& target, std::vector<PickleValue> items) {
    charge(items.size() * sizeof(PickleValue));
    auto& depth = document_.depths_[target.index];
    for (const auto& item : items) depth = std::max(depth, depth_of(item) + 1);
    check_depth(depth);
    auto& container = document_.containers_[target.index];
    container.insert(container.end(), std::make_move_iterator(items.begin()), std::make_move_iterator(items.end()));
  }
  /// A new String or Global of `text`.
  PickleValue make_text(Kind kind, std::string_view text) {
    charge(32 + text.size());
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.texts_.size());
    document_.texts_.emplace_back(text);
    return value;
  }
  /// A new Tensor or Storage.
  PickleValue make_tensor(Kind kind, torch::Tensor tensor) {
    charge(256);  // a TensorImpl and its sizes
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.tensors_.size());
    document_.tensors_.push_back(std::move(tensor));
    return value;
  }

  /// Gives a TorchScript object its attributes (BUILD).
  void set_object_state(const PickleValue& object, const PickleValue& state) {
    auto& depth = document_.depths_[object.index];
    depth = std::max(depth, depth_of(state) + 1);
    check_depth(depth);
    document_.containers_[object.index][1] = state;
  }

  PickleDocument document_;  ///< what is made
  PickleLimits limits_;      ///< the bounds
  PickleStats stats_;        ///< what was used of them
};

}  // namespace trainloop::serialization
