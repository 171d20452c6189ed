#pragma once
/// @file
/// @brief SafetensorsFile: one .safetensors file opened for reading: its header checked
/// (safetensors_header.hpp), then any tensor, or any flat element range of one, read from exactly
/// its bytes with pread. Nothing is mapped and nothing is allocated before its size has been
/// checked against the file's: a sharded model reads its share of each tensor and no more.
///
/// C++17, like the rest of serialization/: the fuzz target (tests/fuzz) builds it with clang 14.

#include <trainloop/error.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/safetensors_header.hpp>

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
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) throw detail::safetensors_error(path_.string(), std::string("cannot be opened (") + std::strerror(errno) + ")");
    fd_ = std::shared_ptr<int>(new int(fd), [](int* owned) {
      ::close(*owned);
      delete owned;
    });
    struct stat info {};
    if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
      throw detail::safetensors_error(path_.string(), "is not a regular file; expected a .safetensors file");
    }
    const auto size = static_cast<uint64_t>(info.st_size);
    if (size < 8) {
      throw detail::safetensors_error(path_.string(), trainloop::detail::concat("is ", size, " bytes long; expected at least 8 ",
                                                                                "(the header's length)"));
    }
    unsigned char length_bytes[8];
    read_bytes(0, length_bytes, 8, "the header's length");
    uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | length_bytes[i];
    if (header_bytes > kSafetensorsMaxHeaderBytes) {
      throw detail::safetensors_error(path_.string(), trainloop::detail::concat("has a header length of ", header_bytes,
                                                                                " bytes; expected at most ",
                                                                                kSafetensorsMaxHeaderBytes, " (100 MB)"));
    }
    if (header_bytes > size - 8) {
      throw detail::safetensors_error(path_.string(), trainloop::detail::concat("has a header length of ", header_bytes,
                                                                                " bytes, longer than the file (", size,
                                                                                " bytes); expected at most ", size - 8));
    }
    std::string json(header_bytes, '\0');
    read_bytes(8, json.data(), header_bytes, "the header");
    data_start_ = 8 + header_bytes;
    header_ = parse_safetensors_header(json, size - data_start_, path_.string());
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
      throw detail::safetensors_error(path_.string(), "has no tensor " + quote_untrusted(name) + "; expected one");
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
      throw detail::safetensors_error(path_.string(), trainloop::detail::concat("has tensor ", quote_untrusted(found.name), " of ",
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
      const auto* values = static_cast<const unsigned char*>(tensor.data_ptr());
      const auto* bad = std::find_if(values, values + bytes, [](unsigned char v) { return v > 1; });
      if (bad != values + bytes) {
        throw detail::safetensors_error(path_.string(), trainloop::detail::concat("has BOOL tensor ", quote_untrusted(found.name),
                                                                                  " holding byte ", int(*bad), " at element ",
                                                                                  begin + (bad - values), "; expected 0 or 1"));
      }
    }
    return tensor;
  }

  void read_bytes(uint64_t offset, void* into, uint64_t count, const std::string& what) const {
    auto* out = static_cast<char*>(into);
    while (count > 0) {
      const size_t chunk = static_cast<size_t>(std::min<uint64_t>(count, uint64_t{1} << 30));
      const ssize_t got = ::pread(*fd_, out, chunk, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got <= 0) {
        throw detail::safetensors_error(path_.string(), "could not be read at " + what + " (" +
                                                            (got == 0 ? std::string("it ended early") : std::strerror(errno)) +
                                                            "); expected a file that does not change while it is read");
      }
      out += got;
      offset += static_cast<uint64_t>(got);
      count -= static_cast<uint64_t>(got);
    }
  }

  std::filesystem::path path_;
  std::shared_ptr<int> fd_;  // shared: copies of a SafetensorsFile read the same open file
  uint64_t data_start_ = 0;
  SafetensorsHeader header_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace trainloop::serialization
