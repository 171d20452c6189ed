#pragma once
/// @file
/// @brief The Python globals a state_dict pickle uses, done in C++: `collections.OrderedDict()`,
/// `torch._utils._rebuild_tensor_v2` (and `_rebuild_tensor`, `_rebuild_parameter`,
/// `_rebuild_parameter_with_state`), the storage classes (`torch.FloatStorage`, ...) and the
/// persistent id `('storage', type, key, location, numel)` by which a tensor names its storage.
/// Any other global is refused, so reading a file runs no code from it (as Python's
/// `torch.load(weights_only=True)`).

#include <trainloop/error.hpp>
#include <trainloop/interop/pickle_value.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::interop::detail {

/// Throws PickleError with the streamed message parts (the unpickler adds where).
template <class... Parts>
[[noreturn]] void pickle_fail(Parts&&... parts) {
  throw PickleError(trainloop::detail::concat(std::forward<Parts>(parts)...));
}

/// The dtype of a storage class (`torch.FloatStorage` ...), or nullopt for another name.
inline std::optional<torch::ScalarType> storage_dtype(const std::string& global) {
  static const std::pair<const char*, torch::ScalarType> classes[] = {
      {"torch.FloatStorage", torch::kFloat},   {"torch.DoubleStorage", torch::kDouble},
      {"torch.HalfStorage", torch::kHalf},     {"torch.BFloat16Storage", torch::kBFloat16},
      {"torch.LongStorage", torch::kLong},     {"torch.IntStorage", torch::kInt},
      {"torch.ShortStorage", torch::kShort},   {"torch.CharStorage", torch::kChar},
      {"torch.ByteStorage", torch::kByte},     {"torch.BoolStorage", torch::kBool},
      {"torch.ComplexFloatStorage", torch::kComplexFloat}, {"torch.ComplexDoubleStorage", torch::kComplexDouble}};
  for (const auto& [name, dtype] : classes) {
    if (global == name) return dtype;
  }
  return std::nullopt;
}

/// A storage as a persistent id names it: `data/<key>` in the archive, `numel` elements of `dtype`.
struct StorageId {
  std::string key;          ///< the record's name under data/
  torch::ScalarType dtype;  ///< from the storage class
  int64_t numel;            ///< elements (not bytes)
};

/// Reads `('storage', torch.FloatStorage, key, location, numel)`. The location (the device it was
/// saved from) is not used: everything is read to the CPU.
inline StorageId parse_storage_id(const PickleValue& id) {
  const auto* fields = id.kind == PickleValue::Kind::Tuple ? id.items.get() : nullptr;
  if (fields == nullptr || fields->size() != 5 || (*fields)[0].text != "storage" ||
      (*fields)[1].kind != PickleValue::Kind::Global || (*fields)[2].kind != PickleValue::Kind::String ||
      (*fields)[4].kind != PickleValue::Kind::Int || (*fields)[4].integer < 0) {
    pickle_fail("a persistent id that is not ('storage', type, key, location, numel)");
  }
  const auto dtype = storage_dtype((*fields)[1].text);
  if (!dtype) pickle_fail("storage type ", (*fields)[1].text, "; expected a typed storage such as torch.FloatStorage");
  return {(*fields)[2].text, *dtype, (*fields)[4].integer};
}

/// The ints of a tuple (a tensor's size or stride); `what` names it for messages.
inline std::vector<int64_t> int_tuple(const PickleValue& value, const char* what) {
  if (value.kind != PickleValue::Kind::Tuple) pickle_fail(what, " is ", a_kind(value.kind), "; expected a tuple of ints");
  std::vector<int64_t> ints;
  for (const auto& item : *value.items) {
    if (item.kind != PickleValue::Kind::Int) pickle_fail(what, " holds ", a_kind(item.kind), "; expected ints");
    ints.push_back(item.integer);
  }
  return ints;
}

/// `_rebuild_tensor_v2(storage, offset, size, stride, ...)`: a view into the storage, as Python
/// makes it, so that tensors that viewed one storage (tied weights, slices) still do.
inline torch::Tensor rebuild_tensor(const std::vector<PickleValue>& args) {
  if (args.size() < 4 || args[0].kind != PickleValue::Kind::Storage || args[1].kind != PickleValue::Kind::Int) {
    pickle_fail("_rebuild_tensor_v2 with arguments other than (storage, offset, size, stride, ...)");
  }
  const auto size = int_tuple(args[2], "a tensor's size");
  const auto stride = int_tuple(args[3], "a tensor's stride");
  const int64_t offset = args[1].integer;
  if (size.size() != stride.size()) pickle_fail("a tensor of ", size.size(), " sizes and ", stride.size(), " strides");
  int64_t last = offset;  // the last element the view reaches
  bool empty = false;
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] < 0 || stride[d] < 0) pickle_fail("a tensor of negative size or stride");
    empty = empty || size[d] == 0;
    last += (size[d] - 1) * stride[d];
  }
  const int64_t numel = args[0].tensor.numel();
  if (offset < 0 || (!empty && last >= numel)) {
    pickle_fail("a tensor of size ", c10::IntArrayRef(size), ", stride ", c10::IntArrayRef(stride), " at offset ",
                offset, " reaches past its storage of ", numel, " elements");
  }
  return args[0].tensor.as_strided(size, stride, offset);
}

/// REDUCE: calls `callable` (a global) with `args` (a tuple), if it is one a state_dict uses.
inline PickleValue call_global(const PickleValue& callable, const PickleValue& args) {
  if (callable.kind != PickleValue::Kind::Global) pickle_fail("REDUCE of ", a_kind(callable.kind), "; expected a global");
  if (args.kind != PickleValue::Kind::Tuple) pickle_fail("REDUCE with ", a_kind(args.kind), "; expected a tuple");
  const auto& name = callable.text;
  const auto& list = *args.items;
  if (name == "collections.OrderedDict" && list.empty()) return PickleValue::of(PickleValue::Kind::Dict);
  PickleValue result = PickleValue::of(PickleValue::Kind::Tensor);
  if (name == "torch._utils._rebuild_tensor_v2" || name == "torch._utils._rebuild_tensor") {
    result.tensor = rebuild_tensor(list);
  } else if (name == "torch._utils._rebuild_parameter" || name == "torch._utils._rebuild_parameter_with_state") {
    // (data, requires_grad, backward_hooks[, state]): the data is all a state_dict needs.
    if (list.empty() || list[0].kind != PickleValue::Kind::Tensor) pickle_fail(name, " of a non-tensor");
    result.tensor = list[0].tensor;
  } else {
    pickle_fail("the pickle calls ", name, "; expected only what a state_dict of tensors uses "
                "(collections.OrderedDict, torch._utils._rebuild_tensor_v2)");
  }
  return result;
}

}  // namespace trainloop::interop::detail
