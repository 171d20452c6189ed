#pragma once
/// @file
/// @brief Opening a file a stranger named, for reading, only when it is a regular file: a FIFO
/// must not block open() forever and a device (`/dev/zero`) must not be read until memory runs
/// out (issue 50). Symbolic links are followed, as Hugging Face's cache needs (its snapshot's
/// `model.safetensors` is a link into `blobs/`); what they lead to must be a regular file.

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>

namespace trainloop::serialization {

/// @brief A descriptor open for reading on a regular file, closed with its last copy.
struct RegularFile {
  std::shared_ptr<int> fd;  ///< the descriptor (shared, so readers may copy it)
  uint64_t size = 0;        ///< the file's size when it was opened
};

/// @brief Opens `path` for reading if it is a regular file (following symbolic links).
/// @param path the file a stranger named (a link is followed to what it names)
/// @param problem set on failure to what is wrong, e.g. "cannot be opened (No such file or
///        directory)" or "is a FIFO, not a regular file"
/// @return the open file, or one whose `fd` is null on failure
inline RegularFile open_regular_file(const std::filesystem::path& path, std::string& problem) {
  // O_NONBLOCK: opening a FIFO for reading otherwise waits for a writer; a regular file ignores it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    problem = std::string("cannot be opened (") + std::strerror(errno) + ")";
    return {};
  }
  RegularFile file;
  file.fd = std::shared_ptr<int>(new int(fd), [](int* owned) {
    ::close(*owned);
    delete owned;
  });
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    problem = std::string("cannot be examined (") + std::strerror(errno) + ")";
    return {};
  }
  if (!S_ISREG(info.st_mode)) {
    problem = S_ISFIFO(info.st_mode)  ? "is a FIFO, not a regular file"
              : S_ISCHR(info.st_mode) ? "is a character device, not a regular file"
              : S_ISBLK(info.st_mode) ? "is a block device, not a regular file"
              : S_ISDIR(info.st_mode) ? "is a directory, not a regular file"
              : S_ISSOCK(info.st_mode) ? "is a socket, not a regular file"
                                       : "is not a regular file";
    return {};
  }
  // Reads block as usual from here on (O_NONBLOCK has no effect on regular files, but say so).
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  file.size = static_cast<uint64_t>(info.st_size);
  return file;
}

/// @brief Reads `count` bytes at `offset` of `fd` into `into`.
/// @return false with `problem` set ("ends early" or the system's reason) when it cannot.
inline bool read_exactly(int fd, uint64_t offset, void* into, uint64_t count, std::string& problem) {
  auto* bytes = static_cast<char*>(into);
  while (count > 0) {
    const ssize_t got = ::pread(fd, bytes, count, static_cast<off_t>(offset));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) {
      problem = got < 0 ? std::string(std::strerror(errno)) : std::string("the file ends early");
      return false;
    }
    bytes += got;
    offset += static_cast<uint64_t>(got);
    count -= static_cast<uint64_t>(got);
  }
  return true;
}

}  // namespace trainloop::serialization
