#pragma once
/// @file
/// @brief The temporary directories a launching process shares with its ranks, and the removal
/// of those that dead launchers left behind.
///
/// A launcher killed by SIGKILL (or the OOM killer) cannot remove its directory; its ranks die
/// with it (PR_SET_PDEATHSIG), so nobody else will. Each directory therefore holds an `owner`
/// file naming the creating process (pid and start time, so a reused pid is not mistaken for
/// it), and every new launcher removes the `trainloop-*` directories in the same parent whose
/// owner is gone.

#include <trainloop/distributed/launch/posix_process.hpp>
#include <trainloop/error.hpp>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <system_error>
#include <unistd.h>

namespace trainloop::distributed {

/// Name of the file in a run directory that says which process owns it.
inline constexpr const char* kRunDirOwnerFile = "owner";

/// The directory temporary run directories go to: $TMPDIR, or /tmp.
inline std::filesystem::path temporary_root() {
  const char* tmp = std::getenv("TMPDIR");
  return std::filesystem::path(tmp && *tmp ? tmp : "/tmp");
}

/// Which machine and pid namespace a pid belongs to (see detail/process_identity.hpp).
using ::trainloop::detail::pid_domain;

/// Creates `<parent>/<prefix>-<pid>-XXXXXX` with an owner file naming this process.
/// @throws trainloop::Error naming the pattern when the directory cannot be created.
inline std::filesystem::path create_owned_directory(const std::filesystem::path& parent, const std::string& prefix) {
  std::string pattern = (parent / (prefix + "-" + std::to_string(::getpid()) + "-XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr) {
    throw Error(::trainloop::detail::concat("trainloop: cannot create a run directory from ", pattern, ": ",
                                            std::strerror(errno), "; expected a writable TMPDIR or /tmp"));
  }
  std::ofstream(std::filesystem::path(pattern) / kRunDirOwnerFile)
      << ::getpid() << ' ' << detail::process_start_time(::getpid()) << ' ' << pid_domain() << '\n';
  return pattern;
}

/// True when `dir` has an owner file whose process, on this machine and in this pid namespace,
/// has ended. Directories owned elsewhere, or without an owner file (yet), are not ours to judge.
inline bool owner_is_gone(const std::filesystem::path& dir) {
  std::ifstream in(dir / kRunDirOwnerFile);
  long pid = 0;
  std::uint64_t start_time = 0;
  std::string domain;
  if (!(in >> pid >> start_time >> domain)) return false;
  if (domain != pid_domain()) return false;
  return !detail::process_alive(pid, start_time);
}

/// Removes the `trainloop-*` directories directly in `parent` whose owner process has ended.
/// Never throws (a directory another cleaner removes first is fine).
/// @return how many were removed.
inline int remove_stale_run_directories(const std::filesystem::path& parent = temporary_root()) noexcept {
  int removed = 0;
  std::error_code error;
  for (std::filesystem::directory_iterator it(parent, error), end; !error && it != end; it.increment(error)) {
    const auto& path = it->path();
    if (path.filename().string().rfind("trainloop-", 0) != 0) continue;
    std::error_code ignored;
    if (!it->is_directory(ignored) || !owner_is_gone(path)) continue;
    if (std::filesystem::remove_all(path, ignored) > 0) ++removed;
  }
  return removed;
}

/// Removes the hand-off files and directories of elastic training (distributed/elastic/elastic_fit.hpp,
/// share_copies.hpp) that the ranks of the launcher `launcher_pid` left in /dev/shm: a rank killed
/// between writing its file and loading it leaves one. They are named after the launcher's pid.
/// Says how many it removed (on stderr; nothing when none): a rank that ended normally leaves none.
inline void remove_elastic_hand_off_files(long launcher_pid) noexcept {
  std::error_code ignored;
  const std::string prefix = "trainloop-elastic-" + std::to_string(launcher_pid) + "-";
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    if (entry.path().filename().string().rfind(prefix, 0) != 0) continue;
    std::filesystem::remove_all(entry.path(), ignored);
    ++removed;
  }
  if (removed > 0) {
    std::cerr << "trainloop: removed " << removed << " elastic hand-off file" << (removed == 1 ? "" : "s")
              << " the ranks left in /dev/shm (a rank killed between writing and loading one leaves it)\n";
  }
}

}  // namespace trainloop::distributed
