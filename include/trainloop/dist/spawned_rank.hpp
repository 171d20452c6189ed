#pragma once
/// @file
/// @brief What a rank started by dist::Launcher does on its side: die with the launcher, and
/// leave its error text where the launcher will quote it.
///
/// First thing in a process where detect_rank_env() says source == Trainloop:
/// @code
///   if (auto env = trainloop::dist::detect_rank_env(); env && env->source == RankEnvSource::Trainloop) {
///     trainloop::dist::die_with_parent();
///     std::exit(trainloop::dist::run_reporting_failure(*env, [&] { train(*env); }));
///   }
/// @endcode

#include <trainloop/dist/rank_env.hpp>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/prctl.h>
#include <system_error>
#include <unistd.h>
#include <utility>

namespace trainloop::dist {


/// In a rank spawned by our Launcher: ask the kernel to SIGKILL this process when the launcher
/// dies, then make sure it has not died already (the race between posix_spawn and prctl: if the
/// parent died first we have been re-parented and kill ourselves). Does nothing in a process
/// that was not spawned by our Launcher (no TRAINLOOP_LAUNCHER_PID).
inline void die_with_parent() {
  auto launcher_pid = detail::env_int(env_names::launcher_pid, 1);
  if (!launcher_pid) return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != static_cast<pid_t>(*launcher_pid)) ::kill(::getpid(), SIGKILL);
}

/// Path of the file where rank `rank` leaves its error text for the launcher.
inline std::filesystem::path rank_error_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / ("rank" + std::to_string(rank) + ".error");
}

/// Writes `what` to `<run_dir>/rank<rank>.error` (via a temporary file renamed into place, so
/// the launcher never reads half a message). Call it before exiting non-zero. Never throws:
/// it runs while a failure is already being handled.
inline void report_rank_failure(const std::string& run_dir, int rank, const std::string& what) noexcept {
  if (run_dir.empty()) return;
  try {
    auto final_path = rank_error_path(run_dir, rank);
    auto temporary = final_path;
    temporary += ".tmp";
    {
      std::ofstream out(temporary, std::ios::trunc);
      out << what;
    }
    std::error_code ignored;
    std::filesystem::rename(temporary, final_path, ignored);
  } catch (...) {
  }
}

/// report_rank_failure for the rank described by `env` (a no-op unless env.source is Trainloop).
inline void report_rank_failure(const RankEnv& env, const std::string& what) noexcept {
  report_rank_failure(env.run_dir, env.rank, what);
}

/// Runs `body()` in a spawned rank; an escaping exception is reported with
/// report_rank_failure and turned into exit status 1.
/// @return the exit status the rank should end with (0 or 1).
template <class Body>
int run_reporting_failure(const RankEnv& env, Body&& body) {
  try {
    std::forward<Body>(body)();
    return 0;
  } catch (const std::exception& error) {
    report_rank_failure(env, error.what());
  } catch (...) {
    report_rank_failure(env, "unknown exception (not derived from std::exception)");
  }
  return 1;
}

}  // namespace trainloop::dist
