#pragma once
/// @file
/// @brief `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, ...)` done in C++ with
/// checked arithmetic: the view a pickle describes is proved inside its storage before any
/// tensor is made of it, so no offset, size or stride from a file can reach memory outside it.

#include <trainloop/error.hpp>
#include <trainloop/serialization/pickle/pickle_value.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// Throws PickleError with the streamed message parts (the unpickler adds where).
template <class... Parts>
[[noreturn]] void pickle_fail(Parts&&... parts) {
  throw PickleError(trainloop::detail::concat(std::forward<Parts>(parts)...));
}

/// @brief `a * b` for the int64 values of a file: overflow is the file's error, naming `what`.
inline int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_mul_overflow(a, b, &out)) pickle_fail(what, " overflows int64 (", a, " * ", b, ")");
  return out;
}
/// @brief `a + b` for the int64 values of a file: overflow is the file's error, naming `what`.
inline int64_t checked_add(int64_t a, int64_t b, const char* what) {
  int64_t out = 0;
  if (__builtin_add_overflow(a, b, &out)) pickle_fail(what, " overflows int64 (", a, " + ", b, ")");
  return out;
}

/// The ints of a tuple (a tensor's size or stride); `what` names it for messages.
inline std::vector<int64_t> int_tuple(const PickleDocument& document, const PickleValue& value, const char* what,
                                      size_t max_length) {
  if (value.kind != PickleValue::Kind::Tuple) pickle_fail(what, " is ", a_kind(value.kind), "; expected a tuple of ints");
  const auto& items = document.items(value);
  if (items.size() > max_length) pickle_fail(what, " has ", items.size(), " dimensions; expected at most ", max_length);
  std::vector<int64_t> ints;
  ints.reserve(items.size());
  for (const auto& item : items) {
    if (item.kind != PickleValue::Kind::Int) pickle_fail(what, " holds ", a_kind(item.kind), "; expected ints");
    ints.push_back(item.integer);
  }
  return ints;
}

/// @brief The tensor that `_rebuild_tensor_v2(storage, offset, size, stride, ...)` makes: a tensor
/// over the storage, as Python makes it, so that tensors that viewed one storage (tied weights,
/// slices) still do. Every element the view reaches — offset + sum((size-1) * stride), each step
/// checked for overflow — must be inside the storage, whose element count its record proved.
/// @param storage the whole storage, 1-d
/// @param offset, size, stride as the pickle gives them
inline torch::Tensor rebuild_tensor_view(const torch::Tensor& storage, int64_t offset, const std::vector<int64_t>& size,
                                         const std::vector<int64_t>& stride) {
  if (size.size() != stride.size()) pickle_fail("a tensor of ", size.size(), " sizes and ", stride.size(), " strides");
  if (offset < 0) pickle_fail("a tensor at offset ", offset, "; expected an offset >= 0");
  bool empty = false;
  int64_t elements = 1;  // of the non-empty dimensions: libtorch multiplies them all
  for (size_t d = 0; d < size.size(); ++d) {
    if (size[d] < 0 || stride[d] < 0) {
      pickle_fail("a tensor of size ", c10::IntArrayRef(size), " and stride ", c10::IntArrayRef(stride),
                  "; expected sizes and strides >= 0");
    }
    if (size[d] == 0) {
      empty = true;
    } else {
      elements = checked_mul(elements, size[d], "a tensor's element count");
    }
  }
  int64_t last = offset;  // the last element the view reaches
  if (!empty) {
    for (size_t d = 0; d < size.size(); ++d) {
      last = checked_add(last, checked_mul(size[d] - 1, stride[d], "a tensor's extent"), "a tensor's extent");
    }
  }
  const int64_t available = storage.numel();
  if ((empty && offset > available) || (!empty && last >= available)) {
    pickle_fail("a tensor of size ", c10::IntArrayRef(size), ", stride ", c10::IntArrayRef(stride), " at offset ",
                offset, " reaches past its storage of ", available, " elements");
  }
  // A tensor of its own over the storage, as Python's _rebuild_tensor makes it (empty().set_()),
  // not a view of the 1-d storage tensor: autograd gives every view a DifferentiableViewMeta,
  // which doubled a tensor's cost (537 vs 264 bytes, libtorch 1.13) in a file of a million views.
  return torch::empty({0}, storage.options()).set_(storage.storage(), offset, size, stride);
}

}  // namespace trainloop::serialization
