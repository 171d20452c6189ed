#pragma once
/// @file
/// @brief Reads the items of a DCP directory (dcp::Metadata from read_metadata, or a writer's):
/// a chunk whole, a bytes value, or any flat range of a tensor assembled from the chunks that
/// overlap it, reading only the bytes it needs where a chunk is a flat range of its tensor.
/// Every item is checked as distcp_item.hpp says, and against its entry's dtype and box.

#include <trainloop/error.hpp>
#include <trainloop/serialization/dcp/distcp_item.hpp>
#include <trainloop/serialization/dcp/flat_range_boxes.hpp>
#include <trainloop/serialization/dcp/metadata.hpp>
#include <trainloop/serialization/dcp/metadata_parse.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace trainloop::serialization::dcp {

/// @brief Reads items of a DCP directory (see the file comment).
class DistcpReader {
 public:
  /// @param directory the checkpoint's directory
  /// @param metadata its metadata (read_metadata checks its files and ranges; this reader checks
  ///        each range again as it opens the item)
  DistcpReader(std::filesystem::path directory, const Metadata& metadata)
      : directory_(std::move(directory)), metadata_(metadata) {
    for (const auto& [fqn, entry] : metadata_.tensors) {
      for (const auto& chunk : entry.chunks) owners_[{chunk.relative_path, chunk.offset}] = &entry;
    }
  }
  DistcpReader(const DistcpReader&) = delete;
  DistcpReader& operator=(const DistcpReader&) = delete;

  /// @brief The whole box of `chunk` (a chunk of this reader's metadata), as its own contiguous CPU tensor.
  /// @throws trainloop::CheckpointError naming the file: the chunk is not in the metadata, or its
  ///         item is not a tensor of its entry's dtype and the chunk's size (distcp_item.hpp).
  torch::Tensor read_chunk(const StoredChunk& chunk) {
    const auto owner = owners_.find({chunk.relative_path, chunk.offset});
    if (owner == owners_.end()) {
      throw CheckpointError(trainloop::detail::concat("trainloop: the item at byte ", chunk.offset, " of ",
                                                      untrusted_file_path(directory_ / chunk.relative_path),
                                                      " is no chunk of this DCP reader's metadata; expected one of its chunks"));
    }
    return read_chunk(*owner->second, chunk);
  }

  /// @brief The whole box of `chunk` of `entry`, as its own contiguous CPU tensor.
  torch::Tensor read_chunk(const TensorEntry& entry, const StoredChunk& chunk) {
    const auto item = open_item(entry, chunk);
    return item.read();
  }

  /// @brief Elements [begin, end) of `entry`'s tensor in row-major order, 1-D, assembled from
  /// the chunks that overlap them. A chunk that is a contiguous flat range of the tensor is read
  /// only where it overlaps (pread of those bytes of its storage record); another is read whole.
  /// Peak memory: the result plus one chunk.
  /// @throws trainloop::CheckpointError naming the file of a bad item, or when the range is not
  ///         inside the tensor or its chunks leave part of it out.
  torch::Tensor read_flat_range(const TensorEntry& entry, int64_t begin, int64_t end) {
    using trainloop::detail::concat;
    const int64_t numel = checked_numel(entry.size);
    if (numel < 0 || begin < 0 || end < begin || end > numel) {
      throw CheckpointError(concat("trainloop: the DCP tensor ", escape_untrusted(entry.fqn), " of size ", c10::IntArrayRef(entry.size), " is read at [", begin,
                                   ", ", end, "); expected a range inside its ", numel, " elements"));
    }
    auto out = torch::empty({end - begin}, torch::TensorOptions().dtype(entry.dtype));
    const auto item_size = static_cast<int64_t>(out.element_size());
    auto* base = static_cast<char*>(out.data_ptr());
    int64_t filled = 0;
    for (const auto& chunk : entry.chunks) {
      const int64_t count = checked_numel(chunk.sizes);
      if (count <= 0 || chunk.sizes.size() != entry.size.size() || chunk.offsets.size() != entry.size.size()) continue;
      if (box_is_flat_range(entry.size, chunk.sizes)) {
        const int64_t first = box_flat_begin(entry.size, chunk.offsets);
        const int64_t from = std::max(begin, first), to = std::min(end, first + count);
        if (from >= to) continue;
        const auto item = open_item(entry, chunk);
        if (item.row_major()) {
          item.read_flat(from - first, to - from, base + (from - begin) * item_size);
        } else {
          const auto whole = item.read();
          std::memcpy(base + (from - begin) * item_size, static_cast<const char*>(whole.data_ptr()) + (from - first) * item_size,
                      static_cast<size_t>((to - from) * item_size));
        }
        filled += to - from;
        continue;
      }
      if (!box_overlaps(entry.size, chunk, begin, end)) continue;
      // Another box: read it whole, then copy its rows' runs that fall in [begin, end).
      const auto whole = open_item(entry, chunk).read();
      const auto* data = static_cast<const char*>(whole.data_ptr());
      const int64_t run = chunk.sizes.back();
      std::vector<int64_t> index(chunk.offsets);  // the current row's first element, per dimension
      for (int64_t row = 0; row < count / run; ++row) {
        const int64_t first = box_flat_begin(entry.size, index);
        const int64_t from = std::max(begin, first), to = std::min(end, first + run);
        if (from < to) {
          std::memcpy(base + (from - begin) * item_size, data + (row * run + from - first) * item_size,
                      static_cast<size_t>((to - from) * item_size));
          filled += to - from;
        }
        for (size_t d = index.size() - 1; d-- > 0;) {  // the next row: odometer over all but the last dimension
          if (++index[d] < chunk.offsets[d] + chunk.sizes[d]) break;
          index[d] = chunk.offsets[d];
        }
      }
    }
    if (filled != end - begin) {
      throw CheckpointError(concat("trainloop: the DCP tensor ", escape_untrusted(entry.fqn), "'s chunks hold ", filled, " of the elements [", begin, ", ", end,
                                   "); expected chunks that cover it once"));
    }
    return out;
  }

  /// @brief The item's raw bytes (a torch.save blob) of a bytes value.
  /// @throws trainloop::CheckpointError naming the file when the item is not inside it.
  std::string read_bytes(const BytesEntry& entry) {
    const auto& file = open_file(entry.relative_path);
    check_range(file, entry.fqn, entry.offset, entry.length);
    std::string bytes(static_cast<size_t>(entry.length), '\0');
    file.read(static_cast<uint64_t>(entry.offset), bytes.data(), bytes.size());
    return bytes;
  }

 private:
  /// True when the box `chunk` has an element in the flat range [begin, end): its first and last
  /// elements bound the flat indices it spans.
  static bool box_overlaps(const std::vector<int64_t>& size, const StoredChunk& chunk, int64_t begin, int64_t end) {
    std::vector<int64_t> last(chunk.offsets);
    for (size_t d = 0; d < last.size(); ++d) last[d] += chunk.sizes[d] - 1;
    return box_flat_begin(size, chunk.offsets) < end && box_flat_begin(size, last) >= begin;
  }

  const ReadOnlyFile& open_file(const std::string& relative_path) {
    auto found = files_.find(relative_path);
    if (found == files_.end()) {
      if (!detail::plain_file_name(relative_path)) {
        throw CheckpointError(trainloop::detail::concat("trainloop: a DCP item is in ", quote_untrusted(relative_path), " of ", directory_.string(),
                                                        "; expected a file name in the checkpoint's directory"));
      }
      auto file = std::make_unique<ReadOnlyFile>(directory_ / relative_path);
      std::error_code error;
      const auto size = std::filesystem::file_size(file->path(), error);
      if (error) {
        throw CheckpointError(trainloop::detail::concat("trainloop: cannot read the size of ", untrusted_file_path(file->path()), " (", error.message(),
                                                        "); expected a readable file"));
      }
      sizes_[relative_path] = size;
      found = files_.emplace(relative_path, std::move(file)).first;
    }
    return *found->second;
  }
  void check_range(const ReadOnlyFile& file, const std::string& fqn, int64_t offset, int64_t length) const {
    const uint64_t size = sizes_.at(file.path().filename().string());  // opened by open_file under this name
    if (offset < 0 || length < 0 || static_cast<uint64_t>(offset) > size || static_cast<uint64_t>(length) > size - static_cast<uint64_t>(offset)) {
      throw CheckpointError(trainloop::detail::concat("trainloop: the DCP data file ", untrusted_file_path(file.path()), " has ", size,
                                                      " bytes, but the item of ", escape_untrusted(fqn), " is at bytes ", offset, "-", offset + length,
                                                      "; expected every item inside its file (is the file truncated?)"));
    }
  }
  DistcpItem open_item(const TensorEntry& entry, const StoredChunk& chunk) {
    const auto& file = open_file(chunk.relative_path);
    check_range(file, entry.fqn, chunk.offset, chunk.length);
    DistcpItem item(file, chunk.offset, chunk.length);
    item.check(entry.fqn, entry.dtype, chunk.sizes);
    return item;
  }

  std::filesystem::path directory_;
  Metadata metadata_;
  std::map<std::pair<std::string, int64_t>, const TensorEntry*> owners_;  // (file, item offset) -> its tensor
  std::map<std::string, std::unique_ptr<ReadOnlyFile>> files_;
  std::map<std::string, uint64_t> sizes_;
};

}  // namespace trainloop::serialization::dcp
