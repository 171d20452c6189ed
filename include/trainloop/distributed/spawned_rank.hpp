#pragma once
/// @file
/// @brief What a rank started by distributed::Launcher does on its side: die with the launcher, say how
/// it failed (or that it finished) through the files of failure_report.hpp.
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
#include <trainloop/distributed/failure_report.hpp>
#include <trainloop/distributed/rank_env.hpp>
#include <trainloop/error.hpp>

#include <cxxabi.h>

#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <sys/prctl.h>
#include <typeinfo>
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

/// How a rank's exception is reported (see failure_report.hpp).
struct FailureDescription {
  std::string type;          ///< C++ type of the exception
  std::string message;       ///< what the user should read first (no backtrace)
  std::string full_text;     ///< everything, backtrace included
  bool consequence = false;  ///< it only reports another rank's failure
};

/// Describes any std::exception: demangled type, what(), and whether it is a CommunicationError
/// or reads like a lost peer. (The DDP engine uses a libtorch-aware version that drops
/// libtorch's backtrace from the message.)
inline FailureDescription describe_exception(const std::exception& error) {
  FailureDescription description;
  int status = 0;
  std::unique_ptr<char, void (*)(void*)> readable(abi::__cxa_demangle(typeid(error).name(), nullptr, nullptr, &status),
                                                  std::free);
  description.type = status == 0 && readable ? readable.get() : typeid(error).name();
  description.message = error.what();
  description.full_text = error.what();
  description.consequence =
      dynamic_cast<const CommunicationError*>(&error) != nullptr || is_peer_failure_text(description.message);
  return description;
}

/// Writes `<run_dir>/rank<rank>.error` and `.error.full` (atomically, so the launcher never reads
/// half a message) and prints the message on this rank's stderr. Never throws: it runs while a
/// failure is already being handled.
inline void report_rank_failure(const std::string& run_dir, int rank, const FailureDescription& failure) noexcept {
  std::fprintf(stderr, "trainloop: rank %d failed: %s\n", rank, failure.message.c_str());
  std::fflush(stderr);
  if (run_dir.empty()) return;
  try {
    ::trainloop::detail::write_file_atomically(rank_full_error_path(run_dir, rank), failure.full_text + "\n",
                                               "the rank's error text");
    ::trainloop::detail::write_file_atomically(
        rank_error_path(run_dir, rank), format_rank_error(failure.type, failure.consequence, failure.message),
        "the rank's error report");
  } catch (...) {
  }
}

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

/// Runs `body()` in a spawned rank; an escaping exception is reported with report_rank_failure
/// (described by `describe`) and turned into exit status 1; success writes the done marker.
/// @return the exit status the rank should end with (0 or 1).
template <class Body, class Describe = FailureDescription (*)(const std::exception&)>
int run_reporting_failure(const RankEnv& env, Body&& body, Describe&& describe = &describe_exception) {
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
