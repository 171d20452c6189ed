#pragma once
/// @file
/// @brief SafetensorsFile: one .safetensors file opened for reading: its header checked
/// (safetensors_header.hpp), then any tensor, or any flat element range of one, read from exactly
/// its bytes with pread. Nothing is mapped and nothing is allocated before its size has been
/// checked against the file's: a sharded model reads its share of each tensor and no more.

#include <trainloop/error.hpp>
#include <trainloop/serialization/bool_bytes.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/regular_file.hpp>
#include <trainloop/serialization/safetensors/safetensors_header.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace trainloop::serialization {

/// @brief A .safetensors file open for reading. Its header is read and checked when it is
/// opened; tensors are read on demand, each from its own bytes. Reads are `const` and use
/// pread, so threads may share one SafetensorsFile.
class SafetensorsFile {
 public:
  /// @brief Opens `path` and checks its header.
  /// @throws trainloop::CheckpointError naming the file when it cannot be opened, is shorter than
  ///         8 bytes, its header length is over 100 MB or longer than the file, or its header is
  ///         not a valid one (see parse_safetensors_header()).
  explicit SafetensorsFile(const std::filesystem::path& path) : path_(path) {
    std::string problem;
    RegularFile file = open_regular_file(path, problem);  // a FIFO or a device is refused, not waited on
    if (!file.fd) throw detail::safetensors_error(untrusted_file_path(path_), problem + "; expected a .safetensors file");
    fd_ = file.fd;
    const uint64_t size = file.size;
    if (size < 8) {
      throw detail::safetensors_error(untrusted_file_path(path_), trainloop::detail::concat("is ", size, " bytes long; expected at least 8 ",
                                                                                "(the header's length)"));
    }
    unsigned char length_bytes[8];
    read_bytes(0, length_bytes, 8, "the header's length");
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
    // The length is not printed: a file that is no safetensors file (a link a stranger's index
    // points elsewhere) would show its first 8 bytes in the message.
    if (header_bytes > kSafetensorsMaxHeaderBytes) {
      throw detail::safetensors_error(untrusted_file_path(path_), trainloop::detail::concat("has a header length (its first 8 bytes) over the limit of ",
                                                                                kSafetensorsMaxHeaderBytes,
                                                                                " bytes (100 MB); expected a .safetensors file"));
    }
    if (header_bytes > size - 8) {
      throw detail::safetensors_error(untrusted_file_path(path_), trainloop::detail::concat("has a header length (its first 8 bytes) beyond the ",
                                                                                size - 8, " bytes after it; expected a .safetensors file"));
    }
    std::string json(header_bytes, '\0');
    read_bytes(8, json.data(), header_bytes, "the header");
    data_start_ = 8 + header_bytes;
    header_ = parse_safetensors_header(json, size - data_start_, untrusted_file_path(path_));
    for (size_t i = 0; i < header_.entries.size(); ++i) index_[header_.entries[i].name] = i;
  }

  /// @brief The file.
  const std::filesystem::path& path() const { return path_; }
  /// @brief Every tensor's name, dtype, shape and bytes, in the order of their data.
  const std::vector<SafetensorsEntry>& entries() const { return header_.entries; }
  /// @brief `__metadata__` (empty when the file has none).
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  /// @brief Whether the file holds a tensor of this name.
  bool contains(const std::string& name) const { return index_.count(name) != 0; }

  /// @brief The entry of tensor `name`.
  /// @throws trainloop::CheckpointError naming the file when it holds no such tensor.
  const SafetensorsEntry& entry(const std::string& name) const {
    const auto found = index_.find(name);
    if (found == index_.end()) {
      throw detail::safetensors_error(untrusted_file_path(path_), "has no tensor " + quote_untrusted(name) + "; expected one");
    }
    return header_.entries[found->second];
  }

  /// @brief Reads tensor `name` (its bytes only) into a new CPU tensor of its dtype and shape.
  /// @throws trainloop::CheckpointError naming the file for a missing name, a failed read, or a
  ///         BOOL byte other than 0 or 1.
  torch::Tensor read(const std::string& name) const {
    const auto& found = entry(name);
    return read_flat(found, 0, found.numel()).view(found.shape);
  }

  /// @brief Reads elements [begin, end) of tensor `name` in row-major order (their bytes only),
  /// as a 1-D CPU tensor: what `tensor.flatten()[begin:end]` holds.
  /// @throws trainloop::CheckpointError naming the file for a missing name, a range outside the
  ///         tensor, a failed read, or a BOOL byte other than 0 or 1.
  torch::Tensor read_flat(const std::string& name, int64_t begin, int64_t end) const {
    return read_flat(entry(name), begin, end);
  }

 private:
  torch::Tensor read_flat(const SafetensorsEntry& found, int64_t begin, int64_t end) const {
    const int64_t numel = found.numel();
    if (begin < 0 || end < begin || end > numel) {
      throw detail::safetensors_error(untrusted_file_path(path_), trainloop::detail::concat("has tensor ", quote_untrusted(found.name), " of ",
                                                                                numel, " elements; the range [", begin, ", ",
                                                                                end, ") asked of it is outside; expected ",
                                                                                "0 <= begin <= end <= ", numel));
    }
    // The entry's bytes were checked to lie inside the file, so this allocation is bounded by its size.
    auto tensor = torch::empty({end - begin}, torch::TensorOptions().dtype(found.dtype));
    const auto item = static_cast<uint64_t>(tensor.element_size());
    const uint64_t bytes = static_cast<uint64_t>(end - begin) * item;
    read_bytes(data_start_ + found.begin + static_cast<uint64_t>(begin) * item, tensor.data_ptr(), bytes,
               "tensor " + quote_untrusted(found.name));
    if (found.dtype == torch::kBool) {
      // A bool byte other than 0 or 1 is undefined behaviour in libtorch's kernels.
      const auto bad = first_invalid_bool_byte(tensor.data_ptr(), static_cast<std::size_t>(bytes));
      if (bad != bytes) {
        throw detail::safetensors_error(untrusted_file_path(path_), trainloop::detail::concat("has BOOL tensor ", quote_untrusted(found.name),
                                                                                  " holding byte ", int(static_cast<const unsigned char*>(tensor.data_ptr())[bad]),
                                                                                  " at element ", begin + static_cast<int64_t>(bad), "; expected 0 or 1"));
      }
    }
    return tensor;
  }

  void read_bytes(uint64_t offset, void* into, uint64_t count, const std::string& what) const {
    std::string problem;
    if (!read_exactly(*fd_, offset, into, count, problem)) {
      throw detail::safetensors_error(untrusted_file_path(path_), "could not be read at " + what + " (" + problem +
                                                          "); expected a file that does not change while it is read");
    }
  }

  std::filesystem::path path_;
  std::shared_ptr<int> fd_;  // shared: copies of a SafetensorsFile read the same open file
  uint64_t data_start_ = 0;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace trainloop::serialization
