#pragma once
/// @file
/// @brief What a rank started by distributed::Launcher does on its side: die with the launcher, say how
/// it failed (or that it finished) through the files of failure_report.hpp (which also has
/// the writing half: report_rank_failure).
///
/// Dying with the launcher needs no call: every program that includes this header (trainloop.hpp
/// does) asks the kernel, before main() runs, to SIGKILL it when its launcher dies, if the
/// environment says it is a rank trainloop spawned. A launcher killed by SIGKILL or the OOM
/// killer then takes its ranks with it at once instead of leaving them to train on.
///
/// A rank program written by hand (tests/launcher_child.cpp does this):
/// @code
///   if (auto env = trainloop::distributed::detect_rank_env(); env && env->source == RankEnvSource::Trainloop) {
///     std::exit(trainloop::distributed::run_reporting_failure(*env, [&] { train(*env); }));
///   }
/// @endcode

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/failure_report.hpp>
#include <trainloop/error.hpp>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <string>
#include <sys/prctl.h>
#include <unistd.h>
#include <utility>

namespace trainloop::distributed {

/// In a rank spawned by our Launcher: ask the kernel to SIGKILL this process when its parent
/// dies, then make sure the launcher has not died already (the race between posix_spawn and
/// prctl: if it died first we have been re-parented and kill ourselves). A process the rank
/// started in turn (it inherits the variables) has another parent but a live launcher, and
/// lives on. Does nothing in a process that was not spawned by our Launcher (no
/// TRAINLOOP_LAUNCHER_PID). Idempotent; never throws.
inline void die_with_parent() noexcept {
  const char* text = std::getenv(env_names::launcher_pid);
  if (text == nullptr || *text == '\0') return;
  char* end = nullptr;
  const long launcher_pid = std::strtol(text, &end, 10);
  if (end == text || *end != '\0' || launcher_pid <= 0) return;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  const bool launcher_gone = ::kill(static_cast<pid_t>(launcher_pid), 0) != 0 && errno == ESRCH;
  if (::getppid() != static_cast<pid_t>(launcher_pid) && launcher_gone) ::kill(::getpid(), SIGKILL);
}

namespace detail {
/// Runs die_with_parent() before main() in every program that includes this header, so a rank
/// dies with its launcher from its first instruction of user code on.
inline const bool rank_dies_with_launcher = (die_with_parent(), true);
}  // namespace detail

/// report_rank_failure for the rank described by `env` (a no-op unless env.source is Trainloop).
inline void report_rank_failure(const RankEnv& env, const FailureDescription& failure) noexcept {
  if (env.source == RankEnvSource::Trainloop) report_rank_failure(env.run_dir, env.rank, failure);
}

/// Tells the launcher this rank finished its work (see LaunchOptions::require_completion).
inline void report_rank_completed(const RankEnv& env) noexcept {
  if (env.source != RankEnvSource::Trainloop || env.run_dir.empty()) return;
  try {
    ::trainloop::detail::write_file_atomically(rank_done_path(env.run_dir, env.rank), "done\n", "the rank's done marker");
  } catch (...) {
  }
}

/// describe_exception with what() for both texts: run_reporting_failure's default.
inline FailureDescription describe_plainly(const std::exception& error) { return describe_exception(error); }

/// Runs `body()` in a spawned rank; an escaping exception is reported with report_rank_failure
/// (described by `describe`) and turned into exit status 1; success writes the done marker.
/// @return the exit status the rank should end with (0 or 1).
template <class Body, class Describe = FailureDescription (*)(const std::exception&)>
int run_reporting_failure(const RankEnv& env, Body&& body, Describe&& describe = &describe_plainly) {
  try {
    std::forward<Body>(body)();
    report_rank_completed(env);
    return 0;
  } catch (const std::exception& error) {
    FailureDescription failure;
    try {
      failure = describe(error);
    } catch (...) {
      failure = describe_exception(error);
    }
    report_rank_failure(env, failure);
  } catch (...) {
    report_rank_failure(env, FailureDescription{"unknown", "unknown exception (not derived from std::exception)",
                                                "unknown exception (not derived from std::exception)", false});
  }
  return 1;
}

}  // namespace trainloop::distributed
