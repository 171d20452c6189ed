#pragma once
/// @file
/// @brief The values of interop/pickle_reader.hpp's unpickler: what a state_dict pickle builds on
/// its stack (numbers, strings, containers, globals, storages, tensors), and its error.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainloop::interop::detail {

/// A pickle that is not a state_dict, or is corrupt; the message says where and why.
class PickleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// One value on the unpickler's stack. Containers are shared, as in Python: a dict reached
/// through the memo (BINGET) and then filled (SETITEMS) is the same dict everywhere.
struct PickleValue {
  /// What the value is.
  enum class Kind { None, Bool, Int, Float, String, Tuple, List, Dict, Global, Storage, Tensor };
  Kind kind = Kind::None;  ///< what it is
  int64_t integer = 0;     ///< Bool, Int
  double real = 0.0;       ///< Float
  std::string text;        ///< String; Global: "module.name"
  /// Tuple and List: the elements; Dict: keys and values alternating, in insertion order.
  std::shared_ptr<std::vector<PickleValue>> items;
  torch::Tensor tensor;  ///< Storage: the whole storage as a 1-d tensor of its dtype; Tensor

  /// A value of a kind that carries nothing else (None, an empty container).
  static PickleValue of(Kind kind) {
    PickleValue value;
    value.kind = kind;
    if (kind == Kind::Tuple || kind == Kind::List || kind == Kind::Dict) {
      value.items = std::make_shared<std::vector<PickleValue>>();
    }
    return value;
  }
};

/// Python's name of a value's kind with its article ("an int", "a dict"), for messages.
inline const char* a_kind(PickleValue::Kind kind) {
  static constexpr const char* names[] = {"None",   "a bool", "an int",   "a float",     "a str",   "a tuple",
                                          "a list", "a dict", "a global", "a storage", "a tensor"};
  return names[static_cast<int>(kind)];
}

}  // namespace trainloop::interop::detail
