#pragma once
/// @file
/// @brief How serialization/pickle/pickle_reader.hpp's unpickler makes values: into one PickleDocument,
/// each text, container and tensor counted against PickleLimits (memory, nesting) as it is made.

#include <trainloop/error.hpp>
#include <trainloop/serialization/pickle/pickle_limits.hpp>
#include <trainloop/serialization/pickle/pickle_value.hpp>
#include <trainloop/serialization/pickle/tensor_rebuild.hpp>

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
///
/// Each value is charged at least what it costs as it is made (so PickleLimits::value_budget
/// bounds the memory, not a count): measured with a million of each on libtorch 1.13 and 2.11,
/// a tensor made with set_ (as Python's _rebuild_tensor) takes 264-300 bytes with its handle, a
/// container's vector 24 bytes plus its items' (vectors grow up to 2x), a text 32 bytes plus its
/// characters, a memo entry ~72 bytes with its share of the hash table, a stack slot 24 (2x as the
/// stack grows). The charges below are those, rounded up, with the growth included.
class PickleBuilder {
 public:
  /// @param limits the bounds of this pickle
  explicit PickleBuilder(PickleLimits limits) : limits_(limits), budget_(limits.max_value_bytes) {}

  /// @brief What the pickle used of the limits so far (complete after Unpickler::run()).
  const PickleStats& stats() const { return stats_; }

 protected:
  using Kind = PickleValue::Kind;  ///< the kinds of values

  static constexpr size_t kTensorCost = 512;     ///< a TensorImpl, its sizes and strides, its slot
  /// ...and per dimension of a tensor of more than 5: c10 keeps 5 sizes and strides inline and moves
  /// all of them to the heap beyond (16 bytes a dimension, the block's header in the 32 below). A
  /// 30 MB file of five million 64-dimensional views took 2 GiB while charged 512 bytes each.
  static constexpr size_t kHeapDimensionCost = 2 * sizeof(int64_t);
  static constexpr size_t kInlineDimensions = 5;  ///< c10::SizesAndStrides' inline capacity
  static constexpr size_t kContainerCost = 64;   ///< an empty container's vector, its slot and depth
  static constexpr size_t kItemCost = 2 * sizeof(PickleValue);  ///< an item, with the vector's growth
  static constexpr size_t kTextCost = 64;        ///< a std::string and its slot, before its characters
  static constexpr size_t kMemoEntryCost = 96;   ///< a node of the memo's hash map and its bucket
  static constexpr size_t kStackSlotCost = 2 * sizeof(PickleValue);  ///< one more value on the stack

  /// Sets the budget from the pickle's size (PickleLimits::value_budget).
  void set_budget_for(size_t pickle_bytes) {
    budget_ = limits_.value_budget(pickle_bytes);
    stats_.value_budget = budget_;
  }
  /// Counts `bytes` of values against the budget.
  void charge(size_t bytes) {
    stats_.value_bytes += bytes;
    if (stats_.value_bytes > budget_) {
      pickle_fail("the pickle's values need more than ", budget_, " bytes (PickleLimits::value_budget of its ",
                  stats_.pickle_bytes, " bytes); expected a file of weights");
    }
  }
  /// Charges the stack's growth to `size` values (only the high-water mark costs memory).
  void charge_stack(size_t size) {
    if (size <= stats_.stack) return;
    charge((size - stats_.stack) * kStackSlotCost);
    stats_.stack = size;
  }
  /// A new container holding `items`.
  PickleValue make_container(Kind kind, std::vector<PickleValue> items) {
    charge(kContainerCost + items.size() * kItemCost);
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.containers_.size());
    document_.containers_.push_back(std::move(items));
    return value;
  }
  /// Appends `items` to the container `target` (a list or dict being filled).
  void extend(const PickleValue& target, std::vector<PickleValue> items) {
    charge(items.size() * kItemCost);
    auto& container = document_.containers_[target.index];
    container.insert(container.end(), std::make_move_iterator(items.begin()), std::make_move_iterator(items.end()));
  }
  /// A new String or Global of `text`.
  PickleValue make_text(Kind kind, std::string_view text) {
    charge(kTextCost + text.size());
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.texts_.size());
    document_.texts_.emplace_back(text);
    return value;
  }
  /// A new Tensor or Storage.
  PickleValue make_tensor(Kind kind, torch::Tensor tensor) {
    const auto dims = static_cast<size_t>(tensor.dim());
    charge(kTensorCost + (dims > kInlineDimensions ? 32 + dims * kHeapDimensionCost : 0));
    PickleValue value;
    value.kind = kind;
    value.index = static_cast<uint32_t>(document_.tensors_.size());
    document_.tensors_.push_back(std::move(tensor));
    return value;
  }

  /// Gives a TorchScript object its attributes (BUILD).
  void set_object_state(const PickleValue& object, const PickleValue& state) {
    document_.containers_[object.index][1] = state;
  }

  /// @brief Measures how deep the finished pickle's containers nest — every container, reachable
  /// from the root or not (libtorch's reader makes and destroys them all) — and refuses more than
  /// PickleLimits::max_depth, or a container that contains itself.
  ///
  /// Why at the end, not as containers are filled: a chain built from the outside in (a list
  /// appended to its parent while empty, then filled) is shallow at every APPEND and a million
  /// deep at the end; counting at each fill let such a chain through to libtorch's recursive
  /// reader. This pass is iterative (its own stack, no recursion) and linear in the items.
  void check_nesting() {
    const auto& containers = document_.containers_;
    enum : uint8_t { kUnseen, kOpen, kDone };
    std::vector<uint8_t> state(containers.size(), kUnseen);
    std::vector<uint32_t> depth(containers.size(), 0);
    struct Frame {
      uint32_t container;
      uint32_t next_item;
    };
    std::vector<Frame> frames;
    uint32_t deepest = 0;
    for (uint32_t start = 0; start < containers.size(); ++start) {
      if (state[start] != kUnseen) continue;
      state[start] = kOpen;
      frames.push_back({start, 0});
      while (!frames.empty()) {
        Frame& frame = frames.back();
        const auto& items = containers[frame.container];
        if (frame.next_item < items.size()) {
          const PickleValue& item = items[frame.next_item++];
          if (!item.is_container()) continue;
          if (state[item.index] == kOpen) pickle_fail("a container contains itself; expected no cycles in a file of weights");
          if (state[item.index] == kUnseen) {
            if (frames.size() >= limits_.max_depth) {
              pickle_fail("the pickle nests containers more than ", limits_.max_depth, " deep; expected at most ",
                          limits_.max_depth);
            }
            state[item.index] = kOpen;
            frames.push_back({item.index, 0});
          }
          continue;
        }
        // Every item is done: this container's depth is one more than its deepest item's.
        uint32_t own = 1;
        for (const auto& item : items) {
          if (item.is_container()) own = std::max(own, depth[item.index] + 1);
        }
        if (own > limits_.max_depth) {
          pickle_fail("the pickle nests containers ", own, " deep; expected at most ", limits_.max_depth);
        }
        depth[frame.container] = own;
        deepest = std::max(deepest, own);
        state[frame.container] = kDone;
        frames.pop_back();
      }
    }
    stats_.depth = deepest;
  }

  PickleDocument document_;  ///< what is made
  PickleLimits limits_;      ///< the bounds
  PickleStats stats_;        ///< what was used of them

 private:
  size_t budget_;  // PickleLimits::value_budget of this pickle, once its size is known
};

}  // namespace trainloop::serialization
