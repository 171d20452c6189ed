#pragma once
/// @file
/// @brief What a torch.distributed.checkpoint (DCP) directory holds, as trainloop reads and
/// writes it: every tensor's dtype, size and chunks (boxes), each chunk's item (a byte range of a
/// `__<rank>_0.distcp` file), the bytes items, and the planner's nested paths. One rank's part of
/// it (DistcpWriter::finish) and the whole (merge_metadata, which checks the parts fit together).

#include <trainloop/error.hpp>
#include <trainloop/serialization/dcp/flat_range_boxes.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainloop::serialization::dcp {

/// @brief A box of a tensor (its first index and extent per dimension) and its item's byte range
/// in a file of the directory.
struct StoredChunk {
  std::vector<int64_t> offsets;  ///< index of the box's first element, per dimension
  std::vector<int64_t> sizes;    ///< extent of the box, per dimension
  std::string relative_path;     ///< the file, relative to the directory ("__0_0.distcp")
  int64_t offset = 0;            ///< the item's first byte in that file
  int64_t length = 0;            ///< the item's bytes (a torch.save blob of the box)
};

/// @brief A tensor of the checkpoint: `TensorStorageMetadata` and its chunks' `_StorageInfo`.
struct TensorEntry {
  std::string fqn;                           ///< flattened name ("model.fc.weight")
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< TensorProperties.dtype
  std::vector<int64_t> size;                 ///< the whole tensor's size
  bool requires_grad = false;                ///< TensorProperties.requires_grad
  std::vector<StoredChunk> chunks;           ///< the boxes that cover it, each stored once
};

/// @brief A non-tensor value of the checkpoint (`BytesStorageMetadata`): its item is a torch.save
/// blob of the Python object (an int, a list...).
struct BytesEntry {
  std::string fqn;            ///< flattened name ("optim.param_groups.0.lr")
  std::string relative_path;  ///< the file, relative to the directory
  int64_t offset = 0;         ///< the item's first byte in that file
  int64_t length = 0;         ///< the item's bytes
};

/// @brief A DCP checkpoint's metadata (Python's `Metadata`), or one rank's part of it.
struct Metadata {
  std::map<std::string, TensorEntry> tensors;  ///< by fqn
  std::map<std::string, BytesEntry> bytes;     ///< by fqn
  /// Flattened key -> the nested path Python's state dict had it at ("model.fc.weight" ->
  /// {"model", "fc.weight"}): `Metadata.planner_data`, which `dcp.load` into an empty dict uses.
  std::map<std::string, std::vector<std::string>> planner_data;
  /// The positions in planner_data[key] that are Python ints (list indices, held as their
  /// decimal text there): "optim.param_groups.0.lr" -> {2}. Absent keys: all strs.
  std::map<std::string, std::vector<size_t>> planner_int_elements;
};

/// @brief Python's name of a dtype as DCP pickles it (`torch.float32` -> "float32"), or "" for a
/// dtype this reader does not name.
inline std::string_view dtype_name(c10::ScalarType dtype) {
  switch (dtype) {
    case c10::ScalarType::Float: return "float32";
    case c10::ScalarType::Double: return "float64";
    case c10::ScalarType::Half: return "float16";
    case c10::ScalarType::BFloat16: return "bfloat16";
    case c10::ScalarType::Long: return "int64";
    case c10::ScalarType::Int: return "int32";
    case c10::ScalarType::Short: return "int16";
    case c10::ScalarType::Char: return "int8";
    case c10::ScalarType::Byte: return "uint8";
    case c10::ScalarType::Bool: return "bool";
    case c10::ScalarType::ComplexFloat: return "complex64";
    case c10::ScalarType::ComplexDouble: return "complex128";
    default: return "";
  }
}

/// @brief The dtype of a Python name ("float32", "float", "long"...), or false.
inline bool dtype_from_name(std::string_view name, c10::ScalarType& dtype) {
  static constexpr std::pair<std::string_view, c10::ScalarType> names[] = {
      {"float32", c10::ScalarType::Float},   {"float", c10::ScalarType::Float},       {"float64", c10::ScalarType::Double},
      {"double", c10::ScalarType::Double},   {"float16", c10::ScalarType::Half},      {"half", c10::ScalarType::Half},
      {"bfloat16", c10::ScalarType::BFloat16}, {"int64", c10::ScalarType::Long},      {"long", c10::ScalarType::Long},
      {"int32", c10::ScalarType::Int},       {"int", c10::ScalarType::Int},           {"int16", c10::ScalarType::Short},
      {"short", c10::ScalarType::Short},     {"int8", c10::ScalarType::Char},         {"uint8", c10::ScalarType::Byte},
      {"bool", c10::ScalarType::Bool},       {"complex64", c10::ScalarType::ComplexFloat},
      {"complex128", c10::ScalarType::ComplexDouble}};
  for (const auto& [known, type] : names) {
    if (name == known) {
      dtype = type;
      return true;
    }
  }
  return false;
}

/// @brief The element count of `size`, or -1 when a size is negative or the product overflows.
inline int64_t checked_numel(const std::vector<int64_t>& size) {
  int64_t numel = 1;
  for (const int64_t extent : size) {
    if (extent < 0 || (extent > 0 && numel > INT64_MAX / extent)) return -1;
    numel *= extent;
  }
  return numel;
}

/// @brief Checks that the chunks of `entry` lie inside the tensor, overlap nowhere, and, when
/// `whole` (a checkpoint, not one rank's part of it), cover it exactly (their elements add up to
/// its own). `source` names the file or part in errors.
/// @throws trainloop::CheckpointError naming the fqn and `source`.
inline void check_chunks_cover(const TensorEntry& entry, const std::string& source, bool whole = true) {
  using trainloop::detail::concat;
  auto fail = [&](const std::string& what) {
    throw CheckpointError(concat("trainloop: ", source, ": the tensor ", escape_untrusted(entry.fqn), " ", what));
  };
  const int64_t numel = checked_numel(entry.size);
  if (numel < 0) fail(concat("has the size ", c10::IntArrayRef(entry.size), "; expected sizes >= 0 whose product fits int64"));
  int64_t covered = 0;
  for (size_t i = 0; i < entry.chunks.size(); ++i) {
    const auto& chunk = entry.chunks[i];
    if (chunk.offsets.size() != entry.size.size() || chunk.sizes.size() != entry.size.size()) {
      fail(concat("has a chunk of ", chunk.offsets.size(), " offsets and ", chunk.sizes.size(), " sizes; expected ",
                  entry.size.size(), " of each (its dimensions)"));
    }
    for (size_t d = 0; d < entry.size.size(); ++d) {
      if (chunk.offsets[d] < 0 || chunk.sizes[d] < 0 || chunk.offsets[d] > entry.size[d] ||
          chunk.sizes[d] > entry.size[d] - chunk.offsets[d]) {
        fail(concat("has the chunk at ", c10::IntArrayRef(chunk.offsets), " of size ", c10::IntArrayRef(chunk.sizes),
                    "; expected a box inside its size ", c10::IntArrayRef(entry.size)));
      }
    }
    if (__builtin_add_overflow(covered, checked_numel(chunk.sizes), &covered) || covered > numel) fail(concat("has chunks of more elements (", covered, ") than its ", numel, "; expected each element stored once"));
  }
  // Overlaps: chunks that are flat ranges (every chunk trainloop writes, and Python's row-wise
  // shards) sorted by their first element, each ending before the next begins: O(n log n). Other
  // boxes pairwise, so a file cannot ask for more than kMaxBoxPairs comparisons.
  constexpr size_t kMaxBoxPairs = size_t{1} << 24;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [first, end) of the non-empty flat chunks
  std::vector<const StoredChunk*> boxes;            // the other non-empty chunks
  for (const auto& chunk : entry.chunks) {
    const int64_t count = checked_numel(chunk.sizes);
    if (count == 0) continue;
    if (box_is_flat_range(entry.size, chunk.sizes)) {
      const int64_t first = box_flat_begin(entry.size, chunk.offsets);
      ranges.emplace_back(first, first + count);
    } else {
      boxes.push_back(&chunk);
    }
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      fail(concat("has chunks that overlap (elements ", ranges[i - 1].first, "-", ranges[i - 1].second, " and ",
                  ranges[i].first, "-", ranges[i].second, "); expected each element stored once"));
    }
  }
  if (!boxes.empty() && (boxes.size() + ranges.size()) * boxes.size() > kMaxBoxPairs) {
    fail(concat("has ", boxes.size(), " chunks that are not flat ranges; expected at most ", kMaxBoxPairs,
                " pairs of them and the others to compare"));
  }
  auto overlap = [&](const std::vector<int64_t>& offsets_a, const std::vector<int64_t>& sizes_a,
                     const std::vector<int64_t>& offsets_b, const std::vector<int64_t>& sizes_b) {
    for (size_t d = 0; d < entry.size.size(); ++d) {
      if (offsets_a[d] >= offsets_b[d] + sizes_b[d] || offsets_b[d] >= offsets_a[d] + sizes_a[d]) return false;
    }
    return true;
  };
  for (size_t i = 0; i < boxes.size(); ++i) {
    for (const auto& other : entry.chunks) {
      if (&other == boxes[i] || checked_numel(other.sizes) == 0) continue;
      if (!box_is_flat_range(entry.size, other.sizes) && &other > boxes[i]) continue;  // each pair of boxes once
      if (overlap(boxes[i]->offsets, boxes[i]->sizes, other.offsets, other.sizes)) {
        fail(concat("has chunks that overlap (at ", c10::IntArrayRef(other.offsets), " and ", c10::IntArrayRef(boxes[i]->offsets),
                    "); expected each element stored once"));
      }
    }
  }
  if (whole && covered != numel) fail(concat("has chunks of ", covered, " of its ", numel, " elements; expected every element stored"));
}

/// @brief Joins the ranks' parts (DistcpWriter::finish of each) into one checkpoint's metadata:
/// the chunks of a tensor from every part, checked to overlap nowhere and to cover the tensor
/// exactly; every part that has a tensor agrees on its dtype and size; a bytes entry in one part.
/// @throws trainloop::CheckpointError naming the fqn.
inline Metadata merge_metadata(const std::vector<Metadata>& parts) {
  using trainloop::detail::concat;
  Metadata merged;
  for (size_t rank = 0; rank < parts.size(); ++rank) {
    const auto& part = parts[rank];
    for (const auto& [fqn, entry] : part.tensors) {
      auto [at, added] = merged.tensors.try_emplace(fqn, entry);
      if (added) continue;
      if (at->second.dtype != entry.dtype || at->second.size != entry.size) {
        throw CheckpointError(concat("trainloop: the DCP parts disagree on the tensor ", fqn, ": part ", rank, " has ",
                                     entry.dtype, " of size ", c10::IntArrayRef(entry.size), ", an earlier part ",
                                     at->second.dtype, " of size ", c10::IntArrayRef(at->second.size),
                                     "; expected every rank to save the same dtype and size"));
      }
      at->second.requires_grad = at->second.requires_grad || entry.requires_grad;
      at->second.chunks.insert(at->second.chunks.end(), entry.chunks.begin(), entry.chunks.end());
    }
    for (const auto& [fqn, entry] : part.bytes) {
      if (merged.tensors.count(fqn) || !merged.bytes.emplace(fqn, entry).second) {
        throw CheckpointError(concat("trainloop: the DCP parts both save ", fqn, " (part ", rank,
                                     " again); expected each bytes value saved by one rank"));
      }
    }
    for (const auto& [fqn, path] : part.planner_data) merged.planner_data.emplace(fqn, path);
    for (const auto& [fqn, ints] : part.planner_int_elements) merged.planner_int_elements.emplace(fqn, ints);
  }
  for (auto& [fqn, entry] : merged.tensors) {
    // A tensor without elements: every rank that wrote its empty chunk wrote the same; one is kept.
    if (checked_numel(entry.size) == 0 && entry.chunks.size() > 1) entry.chunks.resize(1);
    if (merged.bytes.count(fqn)) {
      throw CheckpointError(concat("trainloop: the DCP parts save ", fqn, " as a tensor and as bytes; expected one of them"));
    }
    check_chunks_cover(entry, "the merged DCP metadata");
    // Row-major order of the boxes (every one has the tensor's dimensions now): a flat range's
    // chunks in the order of its elements.
    std::stable_sort(entry.chunks.begin(), entry.chunks.end(),
                     [](const StoredChunk& a, const StoredChunk& b) { return a.offsets < b.offsets; });
  }
  return merged;
}

}  // namespace trainloop::serialization::dcp
