#pragma once
/// @file
/// @brief Writing a file so that a reader, or a crash at any moment, sees either the old file or
/// the complete new one: write a uniquely named temporary file in the same directory, fsync it,
/// rename it over the target, fsync the directory.
///
/// The temporary name is unique (mkstemp), so two writers never share one, and a target that is
/// a directory or sits in a missing or read-only directory gives a trainloop::Error naming the
/// path before anything is written. A failure (disk full) removes the temporary file and leaves
/// the previous target untouched.

#include <trainloop/error.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace trainloop::detail {

/// fsyncs the directory `dir` so that a rename inside it survives a power loss. Best effort:
/// some file systems refuse fsync on directories, which is not an error of ours.
inline void sync_directory(const std::filesystem::path& dir) noexcept {
  const int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

/// This process's umask, read without changing it (umask() would, racing other threads).
inline mode_t process_umask() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Umask:", 0) == 0) return static_cast<mode_t>(std::stoul(line.substr(6), nullptr, 8));
  }
  return 022;
}

/// A temporary file next to `target` that becomes `target` on commit(), or disappears.
class AtomicFile {
 public:
  /// Creates `<target>.tmp.XXXXXX` next to `target`.
  /// @param what what the file is, for messages ("the CSV history file")
  /// @throws trainloop::ConfigurationError when `target` is a directory or its directory is
  ///         missing; trainloop::Error when the temporary file cannot be created (read-only, full).
  AtomicFile(std::filesystem::path target, std::string what) : target_(std::move(target)), what_(std::move(what)) {
    std::error_code ignored;
    TRAINLOOP_CHECK(!std::filesystem::is_directory(target_, ignored), what_, " ", target_.string(),
                    " is a directory; expected a file path");
    const auto dir = target_.has_parent_path() ? target_.parent_path() : std::filesystem::path(".");
    TRAINLOOP_CHECK(std::filesystem::is_directory(dir, ignored), "the directory ", dir.string(), " of ", what_, " ",
                    target_.string(), " does not exist; expected an existing directory");
    std::string pattern = target_.string() + ".tmp.XXXXXX";
    fd_ = ::mkostemp(pattern.data(), O_CLOEXEC);  // not inherited by ranks spawned meanwhile
    if (fd_ < 0) fail("cannot create a temporary file next to it");
    // mkostemp makes 0600; the final file gets the permissions any new file would get.
    ::fchmod(fd_, 0666 & ~process_umask());
    temporary_ = pattern;
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  /// Removes the temporary file unless commit() succeeded.
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_ && !temporary_.empty()) {
      std::error_code ignored;
      std::filesystem::remove(temporary_, ignored);
    }
  }

  /// The temporary file: write to it by name (a libtorch archive's save_to) or with write().
  const std::filesystem::path& temporary() const { return temporary_; }

  /// Appends `bytes` to the temporary file. @throws trainloop::Error naming the target (disk full).
  void write(std::string_view bytes) {
    while (!bytes.empty()) {
      const ssize_t written = ::write(fd_, bytes.data(), bytes.size());
      if (written < 0 && errno == EINTR) continue;
      if (written <= 0) fail("writing it failed");
      bytes.remove_prefix(static_cast<size_t>(written));
    }
  }

  /// fsyncs the temporary file (reopened by name, in case something else wrote it), renames it
  /// over the target and fsyncs the directory. @throws trainloop::Error naming the target.
  void commit() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
    const int fd = ::open(temporary_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("its temporary file vanished");
    const bool synced = ::fsync(fd) == 0;
    const int sync_errno = errno;
    ::close(fd);
    if (!synced) {
      errno = sync_errno;
      fail("flushing it to disk failed");
    }
    if (::rename(temporary_.c_str(), target_.c_str()) != 0) fail("renaming it into place failed");
    committed_ = true;
    sync_directory(target_.has_parent_path() ? target_.parent_path() : std::filesystem::path("."));
  }

 private:
  [[noreturn]] void fail(const char* what_failed) const {
    throw Error(concat("trainloop: cannot write ", what_, " ", target_.string(), ": ", what_failed, " (",
                       std::strerror(errno), "); expected a writable directory with free space (the previous file, if "
                       "any, is unchanged)"));
  }

  std::filesystem::path target_;
  std::string what_;
  std::filesystem::path temporary_;
  int fd_ = -1;
  bool committed_ = false;
};

/// Replaces `target` by a file holding `text`, atomically (see AtomicFile).
inline void write_file_atomically(const std::filesystem::path& target, std::string_view text, const std::string& what) {
  AtomicFile file(target, what);
  file.write(text);
  file.commit();
}

}  // namespace trainloop::detail
