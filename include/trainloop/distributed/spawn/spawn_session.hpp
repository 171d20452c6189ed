#pragma once
/// @file
/// @brief The launching process's spawn session: the directory that keeps the loop's state after
/// each DDP fit() call (fit\<k\>.ckpt) and the record of a failed call (fit\<k\>.failed), so the
/// ranks of a later call can pass the earlier ones (see spawn_relay.hpp).

#include <trainloop/detail/error_context.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/run_directory.hpp>
#include <trainloop/distributed/spawn/relayed_exceptions.hpp>
#include <trainloop/error.hpp>

#include <atomic>
#include <filesystem>
#include <mutex>
#include <string>
#include <system_error>

namespace trainloop::distributed {

namespace detail {

/// The launching process's session directory, created on first use, removed at exit.
class SpawnSession {
 public:
  static SpawnSession& instance() {
    static SpawnSession session;
    return session;
  }
  SpawnSession(const SpawnSession&) = delete;
  SpawnSession& operator=(const SpawnSession&) = delete;
  ~SpawnSession() {
    if (directory_.empty()) return;
    std::error_code ignored;
    std::filesystem::remove_all(directory_, ignored);
  }
  /// The directory (created and the stale ones of dead launchers removed on first call).
  const std::filesystem::path& directory() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (directory_.empty()) {
      remove_stale_run_directories();
      directory_ = create_owned_directory(temporary_root(), "trainloop-session");
    }
    return directory_;
  }

 private:
  SpawnSession() = default;
  std::mutex mutex_;
  std::filesystem::path directory_;
};

/// Numbers the DDP fit() calls of this process: 1, 2, ...
inline int next_fit_index() {
  static std::atomic<int> count{0};
  return ++count;
}

inline std::string fit_state_name(int fit_index) { return "fit" + std::to_string(fit_index); }
/// The loop's state after DDP fit() call `fit_index`, kept in the session for later launches.
inline std::filesystem::path fit_checkpoint_path(const std::filesystem::path& session, int fit_index) {
  return session / (fit_state_name(fit_index) + ".ckpt");
}

/// Renames `from` to `to`. @throws trainloop::Error naming both.
inline void move_file(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::error_code error;
  std::filesystem::rename(from, to, error);
  if (error) {
    throw Error(::trainloop::detail::concat("trainloop: cannot move ", from.string(), " to ", to.string(), ": ",
                                            error.message(), "; expected the session directory to be writable"));
  }
}

/// Path of the record of DDP fit() call `fit_index` having failed in the launching process.
inline std::filesystem::path fit_failure_path(const std::filesystem::path& session, int fit_index) {
  return session / (fit_state_name(fit_index) + ".failed");
}

/// Records that DDP fit() call `fit_index` failed in the launching process with `error` (the
/// class, message and details the caller caught; see relayed_exceptions.hpp).
inline void record_fit_failure(const std::filesystem::path& session, int fit_index, const std::exception& error) noexcept {
  write_failure_record(fit_failure_path(session, fit_index), error);
}

/// Runs the rank side of a failed fit() call again: throws what the caller caught, so the
/// program takes the same path (a catch that retries with a smaller batch) in every rank.
[[noreturn]] inline void replay_fit_failure(const std::filesystem::path& session, int fit_index) {
  replay_failure_record(fit_failure_path(session, fit_index));
}

}  // namespace detail
}  // namespace trainloop::distributed
