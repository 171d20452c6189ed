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
/// A target that already exists (the same checkpoint name written again) is first renamed away
/// under a temporary name and removed after the new one is in place: a kill between the two
/// renames leaves the target missing but the previous one whole under the temporary name, which
/// a reader lists nowhere (and the next writer removes once the owner is dead), the one moment
/// the previous content of that one name is not visible.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>

#include <filesystem>
#include <string>
#include <system_error>

namespace trainloop::detail {

/// Makes the empty temporary directory of `target` for this process (a leftover of the same name,
/// from an earlier failed write of this process, is removed first).
/// @throws trainloop::CheckpointError naming the path and the system's reason.
inline std::filesystem::path make_temporary_directory_for(const std::filesystem::path& target) {
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

/// `to` as a hard link to the file `from`, or a copy where the file system has none.
inline void link_or_copy(const std::filesystem::path& from, const std::filesystem::path& to, std::error_code& error) {
  std::filesystem::create_hard_link(from, to, error);
  if (error) {
    error.clear();
    std::filesystem::copy_file(from, to, std::filesystem::copy_options::overwrite_existing, error);
  }
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
