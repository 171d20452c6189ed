#pragma once
/// @file
/// @brief LiveBytes: the memory a GraphProgram run's values hold at once, each storage once.

#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <cstdint>
#include <unordered_map>
#include <utility>

namespace trainloop::serialization {

/// @brief The bytes of the storages a program run's values hold, each storage counted once
/// however many values view it (GraphProgram::run's memory budget).
class LiveBytes {
 public:
  /// Counts the storages of `value` (a tensor or a list of them) as used once more.
  void add(const c10::IValue& value) { visit(value, +1); }
  /// Counts them as used once less; a storage no value uses any more is no longer counted.
  void remove(const c10::IValue& value) { visit(value, -1); }
  /// The bytes of the storages in use.
  int64_t bytes() const { return bytes_; }

 private:
  void visit(const c10::IValue& value, int sign) {
    if (value.isTensor()) return count(value.toTensor(), sign);
    if (value.isTensorList()) {
      for (const auto& tensor : value.toTensorVector()) count(tensor, sign);
    }
  }
  void count(const torch::Tensor& tensor, int sign) {
    if (!tensor.defined() || !tensor.has_storage()) return;
    const void* key = tensor.storage().unsafeGetStorageImpl();
    if (sign > 0) {
      auto& [bytes, users] = storages_[key];
      if (users++ == 0) {
        bytes = static_cast<int64_t>(tensor.storage().nbytes());
        bytes_ += bytes;
      }
      return;
    }
    const auto found = storages_.find(key);  // a weight's or the input's slot released: never counted
    if (found == storages_.end()) return;
    if (--found->second.second == 0) {
      bytes_ -= found->second.first;
      storages_.erase(found);
    }
  }
  std::unordered_map<const void*, std::pair<int64_t, int64_t>> storages_;  // storage -> (bytes, values using it)
  int64_t bytes_ = 0;
};

}  // namespace trainloop::serialization
