#pragma once
/// @file
/// @brief The values of serialization/pickle/pickle_reader.hpp's unpickler, and the document that owns
/// what they refer to.
///
/// A value is a small handle (kind, number, index); strings, containers and tensors live in one
/// PickleDocument, in flat vectors. Why not values that own their children (as the first version
/// did, through shared_ptr): a file of 10^6 nested lists then destroyed its root by recursing
/// 10^6 times (a SIGSEGV from a 2 KB file), a list appended to itself leaked, and every DUP or
/// BINGET of a string copied it (a 200 KB pickle could ask for 10 GB). With handles, copying a
/// value copies 24 bytes, destroying a document is one pass over its vectors whatever the nesting,
/// and cycles cost nothing.

#include <torch/torch.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace trainloop::serialization {

/// @brief A pickle that is not one trainloop reads, or is corrupt; the message says where and why.
class PickleError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief One value on the unpickler's stack: a handle into its PickleDocument.
struct PickleValue {
  /// What the value is. Object: an instance of a TorchScript class (`__torch__.*`), whose
  /// container holds its class (a Global) and its state (None until BUILD gives it one).
  enum class Kind : uint8_t { None, Bool, Int, Float, String, Tuple, List, Dict, Global, Storage, Tensor, Object };
  Kind kind = Kind::None;  ///< what it is
  uint32_t index = 0;      ///< String, Global: its text; Tuple, List, Dict, Object: its container; Storage, Tensor: its tensor
  int64_t integer = 0;     ///< Bool, Int
  double real = 0.0;       ///< Float

  /// True for the kinds whose items are in a container.
  bool is_container() const {
    return kind == Kind::Tuple || kind == Kind::List || kind == Kind::Dict || kind == Kind::Object;
  }
};

/// @brief Everything the values of one pickle refer to. Dict containers hold keys and values
/// alternating, in insertion order.
class PickleDocument {
 public:
  /// The text of a String or Global.
  const std::string& text(const PickleValue& value) const { return texts_.at(value.index); }
  /// The items of a Tuple, List, Dict (key, value, key, value...) or Object ({class, state}).
  const std::vector<PickleValue>& items(const PickleValue& value) const { return containers_.at(value.index); }
  /// The tensor of a Tensor, or the whole storage (1-d) of a Storage.
  const torch::Tensor& tensor(const PickleValue& value) const { return tensors_.at(value.index); }

  /// The top-level value (what the pickle's STOP returned).
  PickleValue root;

 private:
  friend class PickleBuilder;
  std::vector<std::string> texts_;
  std::vector<std::vector<PickleValue>> containers_;
  std::vector<torch::Tensor> tensors_;
};

/// Python's name of a value's kind with its article ("an int", "a dict"), for messages.
inline const char* a_kind(PickleValue::Kind kind) {
  static constexpr const char* names[] = {"None",     "a bool",   "an int",    "a float",  "a str",
                                          "a tuple",  "a list",   "a dict",    "a global", "a storage",
                                          "a tensor", "an object"};
  return names[static_cast<int>(kind)];
}

}  // namespace trainloop::serialization
