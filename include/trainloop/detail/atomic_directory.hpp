#pragma once
/// @file
/// @brief A directory that several processes fill and that appears at once, whole: a per-rank
/// checkpoint (every rank writes its file into it). The directory is made under a temporary name
/// next to the target (`<target>.trainloop-tmp.<owner tag>.d`, the owner the process that made
/// it), filled, each file fsynced by its writer, then the directory fsynced and renamed into
/// place and its parent fsynced. A kill at any moment leaves either the previous target or the
/// new one; the temporary directory of a writer that died is removed by the next writer in that
/// directory (remove_dead_temporaries).
///
/// A target that already exists (the same checkpoint name written again) is swapped with the new
/// directory in one step (renameat2's RENAME_EXCHANGE), then removed from its temporary name: the
/// name always holds a whole checkpoint. Where the file system cannot exchange, the previous target
/// is renamed away first; a kill between the two renames leaves the name missing, and the next
/// writer's cleaning puts the previous one back (remove_dead_temporaries keeps a dead writer's
/// `.old` whose target is missing) rather than removing it.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <system_error>

namespace trainloop::detail {

/// Makes the empty temporary directory of `target` for this process (a leftover of the same name,
/// from an earlier failed write of this process, is removed first).
/// @throws trainloop::CheckpointError naming the path and the system's reason.
inline std::filesystem::path make_temporary_directory_for(const std::filesystem::path& target) {
  remove_dead_temporaries_once(target.parent_path());  // what writers killed before left here
  const std::filesystem::path temporary = temporary_path_for(target, "d");
  std::error_code error;
  std::filesystem::remove_all(temporary, error);
  error.clear();
  if (!std::filesystem::create_directory(temporary, error) || error) {
    throw CheckpointError(concat("trainloop: cannot create the checkpoint directory ", temporary.string(), ": ",
                                 error ? error.message() : std::string("it exists"),
                                 "; expected a writable directory with free space"));
  }
  return temporary;
}

/// Puts the filled `temporary` directory in place as `target` (see the file comment).
/// @throws trainloop::CheckpointError naming the target and the system's reason; the previous
///         target is then unchanged and `temporary` removed.
inline void commit_directory(const std::filesystem::path& temporary, const std::filesystem::path& target) {
  sync_directory(temporary);
  std::error_code error, absent;  // symlink_status sets `absent` for a target not there yet: no error
  std::filesystem::path previous;
  if (std::filesystem::exists(std::filesystem::symlink_status(target, absent))) {
#if defined(RENAME_EXCHANGE)
    // One step: the name never misses a checkpoint. The previous one is then at `temporary`.
    if (::renameat2(AT_FDCWD, temporary.c_str(), AT_FDCWD, target.c_str(), RENAME_EXCHANGE) == 0) {
      sync_directory(target.parent_path());
      std::filesystem::remove_all(temporary, error);
      return;
    }
#endif
    previous = temporary_path_for(target, "old");
    std::filesystem::remove_all(previous, error);
    std::filesystem::rename(target, previous, error);
  }
  if (!error) std::filesystem::rename(temporary, target, error);
  if (error) {
    std::error_code ignored;
    if (!previous.empty() && !std::filesystem::exists(target, ignored)) std::filesystem::rename(previous, target, ignored);
    std::filesystem::remove_all(temporary, ignored);
    throw CheckpointError(concat("trainloop: cannot write the checkpoint ", target.string(), ": ", error.message(),
                                 "; expected a writable directory (the previous checkpoint is unchanged)"));
  }
  sync_directory(target.parent_path());
  if (!previous.empty()) std::filesystem::remove_all(previous, error);
}

/// Puts the file `file` (written and fsynced inside the temporary directory `temporary`) in the
/// place of `target`, a per-rank checkpoint's directory of the same name: the directory is moved
/// aside, the file renamed into place, the directory removed (a kill between the two renames:
/// remove_dead_temporaries puts the directory back).
/// @throws trainloop::CheckpointError naming the target; the previous one is then unchanged.
inline void replace_with_file(const std::filesystem::path& temporary, const std::filesystem::path& file,
                              const std::filesystem::path& target) {
  std::error_code error;
  const std::filesystem::path previous = temporary_path_for(target, "old");
  std::filesystem::remove_all(previous, error);
  std::filesystem::rename(target, previous, error);
  if (!error) std::filesystem::rename(file, target, error);
  std::error_code ignored;
  if (error) {
    if (!std::filesystem::exists(target, ignored)) std::filesystem::rename(previous, target, ignored);
    std::filesystem::remove_all(temporary, ignored);
    throw CheckpointError(concat("trainloop: cannot write the checkpoint ", target.string(), ": ", error.message(),
                                 "; expected a writable directory (the previous checkpoint is unchanged)"));
  }
  sync_directory(target.parent_path());
  std::filesystem::remove_all(previous, ignored);
  std::filesystem::remove_all(temporary, ignored);
}

/// `to` as a hard link to the file `from`, or a copy where the file system has none.
inline void link_or_copy(const std::filesystem::path& from, const std::filesystem::path& to, std::error_code& error) {
  std::filesystem::create_hard_link(from, to, error);
  if (!error) return;
  error.clear();
  std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, error);
  if (error) return;
  const int fd = ::open(to.c_str(), O_RDONLY | O_CLOEXEC);  // a copy is durable before it is renamed into place
  if (fd < 0 || ::fsync(fd) != 0) error = std::error_code(errno, std::generic_category());
  if (fd >= 0) ::close(fd);
}

/// Makes `link` a symbolic link to `target` (a name relative to the link's directory), atomically: a new
/// link under a temporary name renamed over it, then the directory synced. Returns the error, if any
/// (nothing is left behind then).
inline std::error_code symlink_atomically(const std::filesystem::path& target, const std::filesystem::path& link) {
  const std::filesystem::path temporary = unique_temporary_path_for(link);
  std::error_code error;
  std::filesystem::create_symlink(target, temporary, error);
  if (!error) std::filesystem::rename(temporary, link, error);
  if (error) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    return error;
  }
  sync_directory(link.parent_path());
  return {};
}

/// Makes `link` a second name of `target`, atomically (a hard link under a temporary name, renamed).
/// A per-rank checkpoint (a directory) gets a directory of hard links to its files, put in place
/// as a whole (commit_directory).
inline void link_atomically(const std::filesystem::path& target, const std::filesystem::path& link) {
  std::error_code error;
  if (std::filesystem::is_directory(target, error)) {
    const std::filesystem::path temporary = make_temporary_directory_for(link);
    for (std::filesystem::directory_iterator it(target, error), end; !error && it != end; it.increment(error)) {
      link_or_copy(it->path(), temporary / it->path().filename(), error);
      if (error) break;
    }
    if (error) {
      std::error_code ignored;
      std::filesystem::remove_all(temporary, ignored);
      throw CheckpointError(concat("trainloop: cannot write the checkpoint ", link.string(), ": ",
                                   error.message(), "; expected a writable directory with free space"));
    }
    commit_directory(temporary, link);
    return;
  }
  const std::filesystem::path temporary = unique_temporary_path_for(link);
  link_or_copy(target, temporary, error);
  if (!error) std::filesystem::rename(temporary, link, error);
  if (error) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw CheckpointError(concat("trainloop: cannot write the checkpoint ", link.string(), ": ",
                                 error.message(), "; expected a writable directory with free space"));
  }
  sync_directory(link.parent_path());
}

}  // namespace trainloop::detail
