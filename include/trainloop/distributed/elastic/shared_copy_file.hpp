#pragma once
/// @file
/// @brief Elastic training of sharded state on one machine: a rank's copy of its shares in a file
/// of /dev/shm, mapped into its memory, which outlives the rank (share_copies.hpp).
///
/// A rank's neighbour keeps its copy so the shares survive the rank's death. When the neighbour
/// is on the same machine, the copy need not travel at all: a file in /dev/shm survives the
/// process that wrote it, and the neighbour reads it only after a loss. So the rank copies its
/// shares straight into the file's mapping (no second copy in its memory, none in the
/// neighbour's, nothing on the wire) and tells the neighbour the file's name. Measured in
/// docs/elastic.md ("What it costs").
///
/// The file: the block of copied boxes, then their descriptor (box_descriptor.hpp), then a trailer
/// of four numbers (the descriptor's length, the block's length, the step, a mark). The trailer
/// is written last and cut off (the file truncated to the block) before the block is written
/// again, so a rank killed while copying leaves a file that names no step: read_shared_copy()
/// refuses it. The file's pages are reserved when it is made (posix_fallocate): a /dev/shm that
/// fills up later cannot turn the copy into a SIGBUS.

#include <trainloop/detail/format.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <memory>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <system_error>
#include <unistd.h>
#include <utility>

namespace trainloop::distributed::elastic {

namespace detail {

constexpr int64_t kSharedCopyMark = 0x79706f6365726873;  // "shrecopy"
constexpr int64_t kSharedCopyTrailerBytes = 32;

/// A mapping of a file, unmapped when the last tensor that views it goes. `shared`: writes reach
/// the file (the writer's); else they stay private (a reader's: no view of it can fault on a write).
struct FileMapping {
  void* at = MAP_FAILED;
  size_t length = 0;
  /// (A reader's pages mapped at once, MAP_POPULATE, made a recovery no faster: 2026-11-30, the
  /// keeper's 403 MB took 390 ms to map and 720 ms to write into the hand-off, against 0 and
  /// 720-880 ms faulting page by page — docs/elastic.md.)
  FileMapping(int fd, size_t bytes, bool shared)
      : at(::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, shared ? MAP_SHARED : MAP_PRIVATE, fd, 0)),
        length(bytes) {}
  FileMapping(const FileMapping&) = delete;
  FileMapping& operator=(const FileMapping&) = delete;
  ~FileMapping() {
    if (at != MAP_FAILED) ::munmap(at, length);
  }
};

/// The first `bytes` of `mapping` as a 1-D uint8 tensor that keeps the mapping alive.
inline torch::Tensor view_of(const std::shared_ptr<FileMapping>& mapping, int64_t bytes) {
  if (bytes == 0) return torch::empty({0}, torch::kUInt8);
  auto keep = new std::shared_ptr<FileMapping>(mapping);
  return torch::from_blob(mapping->at, {bytes}, [keep](void*) { delete keep; }, torch::kUInt8);
}

/// Writes all of `bytes` at `offset` (pwrite may write less).
inline bool write_all_at(int fd, const char* bytes, size_t length, off_t offset) {
  while (length > 0) {
    const ssize_t wrote = ::pwrite(fd, bytes, length, offset);
    if (wrote < 0 && errno == EINTR) continue;
    if (wrote <= 0) return false;
    bytes += wrote;
    length -= static_cast<size_t>(wrote);
    offset += wrote;
  }
  return true;
}

/// Reads all of `length` bytes at `offset`.
inline bool read_all_at(int fd, char* bytes, size_t length, off_t offset) {
  while (length > 0) {
    const ssize_t got = ::pread(fd, bytes, length, offset);
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) return false;
    bytes += got;
    length -= static_cast<size_t>(got);
    offset += got;
  }
  return true;
}

}  // namespace detail

/// @brief One slot's copy of this rank's shares in a file of /dev/shm (see the file comment).
class SharedCopyFile {
 public:
  SharedCopyFile() = default;
  SharedCopyFile(const SharedCopyFile&) = delete;
  SharedCopyFile& operator=(const SharedCopyFile&) = delete;
  /// Takes `other`'s file (a slot reset by assignment).
  SharedCopyFile(SharedCopyFile&& other) noexcept { take(other); }
  /// Removes this file and takes `other`'s.
  SharedCopyFile& operator=(SharedCopyFile&& other) noexcept {
    if (this != &other) {
      remove();
      take(other);
    }
    return *this;
  }
  ~SharedCopyFile() { remove(); }

  /// A block of `bytes` mapped from the file `path` (made, or resized: earlier views of it stay
  /// valid until they go), its pages reserved; an undefined tensor when that fails (no room).
  torch::Tensor block(const std::filesystem::path& path, int64_t bytes) {
    remove();
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return torch::Tensor();
    fd_ = fd;
    path_ = path;
    // posix_fallocate returns the error rather than setting errno; tmpfs supports it (Linux 3.5).
    if (bytes > 0 && ::posix_fallocate(fd_, 0, bytes) != 0) {
      remove();
      return torch::Tensor();
    }
    if (::ftruncate(fd_, bytes) != 0) {
      remove();
      return torch::Tensor();
    }
    block_bytes_ = bytes;
    if (bytes == 0) return torch::empty({0}, torch::kUInt8);
    auto mapping = std::make_shared<detail::FileMapping>(fd_, static_cast<size_t>(bytes), /*shared=*/true);
    if (mapping->at == MAP_FAILED) {
      remove();
      return torch::Tensor();
    }
    block_ = detail::view_of(mapping, bytes);
    return block_;
  }

  /// True when `block` is this file's mapping (what block() returned).
  bool holds(const torch::Tensor& block) const {
    return fd_ >= 0 && block.defined() && block_.defined() && block.data_ptr() == block_.data_ptr() &&
           block.numel() == block_bytes_;
  }

  /// Before the block is written again: the file names no step until seal().
  /// @throws trainloop::CommunicationError when the file cannot be cut.
  void unseal() {
    if (::ftruncate(fd_, block_bytes_) != 0) {
      throw CommunicationError(::trainloop::detail::concat("trainloop: cannot cut the copy of this rank's shares in ", path_.string(),
                                                           " (", std::strerror(errno), ")"));
    }
  }

  /// The block holds step `step`, whose boxes `descriptor` describes: written after it, last the
  /// trailer. False when /dev/shm could not take them (the file then names no step).
  bool seal(const torch::Tensor& descriptor, int64_t step) {
    const int64_t trailer[4] = {descriptor.numel(), block_bytes_, step, detail::kSharedCopyMark};
    const bool wrote =
        detail::write_all_at(fd_, static_cast<const char*>(descriptor.data_ptr()), static_cast<size_t>(descriptor.numel()), block_bytes_) &&
        detail::write_all_at(fd_, reinterpret_cast<const char*>(trailer), sizeof(trailer), block_bytes_ + descriptor.numel());
    if (!wrote && ::ftruncate(fd_, block_bytes_) != 0) remove();  // a part of a trailer must not stay
    return wrote;
  }

  /// The file's name (empty when there is none).
  const std::filesystem::path& path() const { return path_; }

  /// Closes and removes the file; views of its block stay valid until they go.
  void remove() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    std::error_code ignored;
    if (!path_.empty()) std::filesystem::remove(path_, ignored);
    path_.clear();
    block_ = torch::Tensor();
    block_bytes_ = 0;
  }

 private:
  void take(SharedCopyFile& other) noexcept {
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    other.path_.clear();
    block_ = std::move(other.block_);
    block_bytes_ = std::exchange(other.block_bytes_, 0);
  }

  int fd_ = -1;
  std::filesystem::path path_;
  torch::Tensor block_;  // the mapping's view, to recognise it (holds())
  int64_t block_bytes_ = 0;
};

/// The copy of step `step` in the file `path` (a SharedCopyFile's, perhaps of a rank that is gone):
/// its descriptor, and its block mapped read-only. Every length is checked against the file.
/// @throws trainloop::CommunicationError when the file is missing, names another step or no step
///         (its writer was killed while copying), or does not hold what its trailer says.
inline std::pair<torch::Tensor, torch::Tensor> read_shared_copy(const std::filesystem::path& path, int64_t step) {
  auto fail = [&](const std::string& why) {
    return CommunicationError(::trainloop::detail::concat("trainloop: the copy of a neighbour's shares of step ", step, " in ",
                                                          path.string(), " ", why, "; expected the file its rank sealed"));
  };
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw fail(::trainloop::detail::concat("cannot be opened (", std::strerror(errno), ")"));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat status {};
  if (::fstat(fd, &status) != 0 || status.st_size < detail::kSharedCopyTrailerBytes) throw fail("holds no trailer");
  const int64_t size = status.st_size;
  int64_t trailer[4] = {};
  if (!detail::read_all_at(fd, reinterpret_cast<char*>(trailer), sizeof(trailer), size - detail::kSharedCopyTrailerBytes)) {
    throw fail("cannot be read");
  }
  const auto [descriptor_bytes, block_bytes, sealed_step, mark] = trailer;
  if (mark != detail::kSharedCopyMark) throw fail("was not sealed (its rank was lost while copying)");
  if (sealed_step != step) throw fail(::trainloop::detail::concat("holds step ", sealed_step));
  if (descriptor_bytes < 0 || block_bytes < 0 || descriptor_bytes > size || block_bytes > size ||
      descriptor_bytes + block_bytes + detail::kSharedCopyTrailerBytes != size) {
    throw fail(::trainloop::detail::concat("is ", size, " bytes, its trailer says ", block_bytes, " + ", descriptor_bytes, " + ",
                                           detail::kSharedCopyTrailerBytes));
  }
  torch::Tensor descriptor = torch::empty({descriptor_bytes}, torch::kUInt8);
  if (!detail::read_all_at(fd, static_cast<char*>(descriptor.data_ptr()), static_cast<size_t>(descriptor_bytes), block_bytes)) {
    throw fail("cannot be read");
  }
  if (block_bytes == 0) return {descriptor, torch::empty({0}, torch::kUInt8)};
  auto mapping = std::make_shared<detail::FileMapping>(fd, static_cast<size_t>(block_bytes), /*shared=*/false);
  if (mapping->at == MAP_FAILED) throw fail(::trainloop::detail::concat("cannot be mapped (", std::strerror(errno), ")"));
  return {descriptor, detail::view_of(mapping, block_bytes)};
}

}  // namespace trainloop::distributed::elastic
