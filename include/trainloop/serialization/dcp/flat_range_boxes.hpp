#pragma once
/// @file
/// @brief A flat range of a row-major tensor's elements as the boxes (offsets, sizes) that
/// torch.distributed.checkpoint thinks in: what a rank that holds elements [begin, end) of a
/// flattened tensor (a ZeRO or FSDP shard) writes as DCP chunks, so Python's DCP can read them.

#include <trainloop/error.hpp>

#include <cstdint>
#include <utility>
#include <vector>

namespace trainloop::serialization::dcp {

/// @brief One box of a tensor: the index of its first element in every dimension, and its extent.
using Box = std::pair<std::vector<int64_t>, std::vector<int64_t>>;

namespace detail {

/// Elements [begin, end) of the sub-tensor of dimensions `dim`... (the outer ones fixed at `prefix`).
inline void add_boxes(const std::vector<int64_t>& size, const std::vector<int64_t>& inner, size_t dim,
                      std::vector<int64_t>& prefix, int64_t begin, int64_t end, std::vector<Box>& out) {
  // Iterative over the dimensions: at each, at most a head (a partial row, finished one level
  // down), a middle of whole rows (one box) and a tail (a partial row, one level down). Only one
  // of head and tail recurses further with both ends partial, so no stack grows with the data.
  while (begin < end) {
    const int64_t row = inner[dim];  // elements of one index of dimension `dim`
    auto box = [&](int64_t first, int64_t count) {
      std::vector<int64_t> offsets = prefix, sizes(prefix.size(), 1);
      offsets.push_back(first);
      sizes.push_back(count);
      for (size_t d = dim + 1; d < size.size(); ++d) {
        offsets.push_back(0);
        sizes.push_back(size[d]);
      }
      out.emplace_back(std::move(offsets), std::move(sizes));
    };
    if (begin % row == 0 && end % row == 0) {
      box(begin / row, (end - begin) / row);
      return;
    }
    int64_t first = begin / row;
    const int64_t last = end / row;  // the row `end` falls in (partial: end % row != 0, or a whole row before it)
    if (first == last) {             // inside one row: one level down
      prefix.push_back(first);
      begin -= first * row;
      end -= first * row;
      ++dim;
      continue;
    }
    if (begin % row != 0) {  // head: the rest of row `first`
      prefix.push_back(first);
      std::vector<int64_t> head_prefix = prefix;
      prefix.pop_back();
      add_boxes(size, inner, dim + 1, head_prefix, begin - first * row, row, out);
      ++first;
    }
    if (last > first) box(first, last - first);
    if (end % row == 0) return;
    prefix.push_back(last);  // tail: the start of row `last`
    begin = 0;
    end -= last * row;
    ++dim;
  }
}

}  // namespace detail

/// @brief The boxes covering elements [begin, end) of a row-major tensor of shape `size`, in
/// order: at most 2 * (dims - 1) + 1 boxes, each a contiguous flat range of the tensor. A
/// 0-dimensional tensor has one element: [0, 1) is the box ({}, {}).
/// @throws trainloop::CheckpointError when a size is negative or the range is not inside the tensor.
inline std::vector<Box> flat_range_boxes(const std::vector<int64_t>& size, int64_t begin, int64_t end) {
  int64_t numel = 1;
  for (const int64_t extent : size) {
    if (extent < 0 || (extent > 0 && numel > INT64_MAX / extent)) {
      throw CheckpointError(trainloop::detail::concat("trainloop: a DCP tensor's size has ", extent,
                                                      " in a dimension; expected sizes >= 0 whose product fits int64"));
    }
    numel *= extent;
  }
  if (begin < 0 || end < begin || end > numel) {
    throw CheckpointError(trainloop::detail::concat("trainloop: the flat range [", begin, ", ", end, ") is not inside a tensor of ",
                                                    numel, " elements; expected 0 <= begin <= end <= ", numel));
  }
  std::vector<Box> out;
  if (begin == end) return out;
  if (size.empty()) {
    out.emplace_back();
    return out;
  }
  // inner[d]: elements of one index of dimension d (the product of the sizes after it).
  std::vector<int64_t> inner(size.size(), 1);
  for (size_t d = size.size() - 1; d > 0; --d) inner[d - 1] = inner[d] * size[d];
  std::vector<int64_t> prefix;
  detail::add_boxes(size, inner, 0, prefix, begin, end, out);
  return out;
}

/// @brief The flat index (row-major) of a box's first element in a tensor of shape `size`.
inline int64_t box_flat_begin(const std::vector<int64_t>& size, const std::vector<int64_t>& offsets) {
  int64_t flat = 0;
  for (size_t d = 0; d < size.size(); ++d) flat = flat * size[d] + offsets[d];
  return flat;
}

/// @brief True when the box (offsets, sizes) of a tensor of shape `size` is one contiguous flat
/// range of it: every dimension after the first partial one is whole, and every one before it is 1.
inline bool box_is_flat_range(const std::vector<int64_t>& size, const std::vector<int64_t>& sizes) {
  size_t d = 0;
  while (d < sizes.size() && sizes[d] == 1) ++d;  // leading dimensions of extent 1
  if (d < sizes.size()) ++d;                      // the one partial dimension
  for (; d < sizes.size(); ++d) {
    if (sizes[d] != size[d]) return false;
  }
  return true;
}

}  // namespace trainloop::serialization::dcp
