#pragma once
/// @file
/// @brief The boxes of a block of copied shares as bytes (elastic training of sharded state:
/// share_copies.hpp): their keys, dtypes, places in the whole tensors and in the block — what the
/// neighbour that keeps a rank's block needs to write it as that rank's checkpoint file. Read
/// back, every number is checked against the message and the block: nothing is read out of bounds.

#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::distributed::elastic::detail {

constexpr int64_t kBoxesMagic = 0x736f7870;  // "pxos": a descriptor of copied boxes

/// The boxes of a block as bytes (see the file comment).
inline torch::Tensor encode_boxes(const std::vector<::trainloop::detail::CapturedBox>& boxes) {
  std::vector<int64_t> numbers{kBoxesMagic, static_cast<int64_t>(boxes.size())};
  std::string keys;
  for (const auto& box : boxes) {
    const torch::Tensor& buffer = box.buffer;
    numbers.push_back(static_cast<int64_t>(buffer.scalar_type()));
    numbers.push_back(static_cast<int64_t>(box.size.size()));
    numbers.insert(numbers.end(), box.offsets.begin(), box.offsets.end());
    numbers.insert(numbers.end(), box.size.begin(), box.size.end());
    for (int64_t extent : buffer.sizes()) numbers.push_back(extent);
    numbers.push_back(buffer.storage_offset() * static_cast<int64_t>(buffer.element_size()));
    numbers.push_back(static_cast<int64_t>(box.key.size()));
    keys += box.key;
  }
  torch::Tensor bytes = torch::empty({static_cast<int64_t>(numbers.size() * 8 + keys.size())}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), numbers.data(), numbers.size() * 8);
  if (!keys.empty()) std::memcpy(static_cast<char*>(bytes.data_ptr()) + numbers.size() * 8, keys.data(), keys.size());
  return bytes;
}

/// The boxes `encoded` describes, their buffers views into `block`. Every number is checked
/// against the message and the block (a rank's own job sent it, but nothing is read out of bounds).
/// @throws trainloop::CommunicationError naming what does not fit.
inline std::vector<::trainloop::detail::CapturedBox> decode_boxes(const torch::Tensor& encoded, const torch::Tensor& block) {
  const int64_t total = encoded.numel();
  const auto* bytes = static_cast<const char*>(encoded.data_ptr());
  int64_t at = 0;
  auto bad = [&](const std::string& what) {
    return CommunicationError(::trainloop::detail::concat("trainloop: a neighbour's copy of sharded state is malformed (",
                                                          what, "); expected the layout this release sends"));
  };
  auto number = [&]() {
    if (at + 8 > total) throw bad("the descriptor ends early");
    int64_t value = 0;
    std::memcpy(&value, bytes + at, 8);
    at += 8;
    return value;
  };
  if (number() != kBoxesMagic) throw bad("no descriptor mark");
  const int64_t count = number();
  if (count < 0 || count > total / 8) throw bad(::trainloop::detail::concat(count, " boxes"));
  struct Raw {
    c10::ScalarType dtype;
    std::vector<int64_t> offsets, size, sizes;
    int64_t byte_offset = 0, key_length = 0;
  };
  std::vector<Raw> raws;
  for (int64_t i = 0; i < count; ++i) {
    Raw raw;
    const int64_t dtype = number();
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) throw bad(::trainloop::detail::concat("dtype ", dtype));
    raw.dtype = static_cast<c10::ScalarType>(dtype);
    // Only element types a share can hold: no size (Undefined) or no plain view of bytes
    // (quantized, bits) would fail inside libtorch with its own error, not this one.
    if (raw.dtype == c10::ScalarType::Undefined || c10::isQIntType(raw.dtype) || c10::isBitsType(raw.dtype)) {
      throw bad(::trainloop::detail::concat("dtype ", raw.dtype));
    }
    const int64_t dims = number();
    if (dims < 0 || dims > 16) throw bad(::trainloop::detail::concat(dims, " dimensions"));
    for (int64_t d = 0; d < dims; ++d) raw.offsets.push_back(number());
    for (int64_t d = 0; d < dims; ++d) raw.size.push_back(number());
    for (int64_t d = 0; d < dims; ++d) raw.sizes.push_back(number());
    raw.byte_offset = number();
    raw.key_length = number();
    raws.push_back(std::move(raw));
  }
  std::vector<::trainloop::detail::CapturedBox> boxes;
  for (Raw& raw : raws) {
    if (raw.key_length < 0 || raw.key_length > total - at) throw bad("a key runs past the descriptor");
    std::string key(bytes + at, static_cast<size_t>(raw.key_length));
    at += raw.key_length;
    int64_t elements = 1;
    for (size_t d = 0; d < raw.sizes.size(); ++d) {
      if (raw.sizes[d] < 0 || raw.offsets[d] < 0 || raw.size[d] < 0 || raw.offsets[d] > raw.size[d] - raw.sizes[d]) {
        throw bad("a box outside its tensor");
      }
      if (raw.sizes[d] > 0 && elements > std::numeric_limits<int64_t>::max() / 16 / raw.sizes[d]) throw bad("a box too large");
      elements *= raw.sizes[d];
    }
    const int64_t item = static_cast<int64_t>(c10::elementSize(raw.dtype));
    const int64_t length = elements * item;
    if (raw.byte_offset < 0 || raw.byte_offset % item != 0 || raw.byte_offset > block.numel() - length) {
      throw bad("a box outside the block");
    }
    torch::Tensor buffer = block.narrow(0, raw.byte_offset, length).view(raw.dtype).view(raw.sizes);
    boxes.push_back({std::move(key), std::move(raw.offsets), std::move(raw.size), torch::Tensor(), std::move(buffer), true});
  }
  if (at != total) throw bad("bytes after the last key");
  return boxes;
}

}  // namespace trainloop::distributed::elastic::detail
