#pragma once
/// @file
/// @brief DistributedDataParallel in a plain program: fit() re-executes the program once per
/// rank and relays the model, the optimizer and the History between the caller and its ranks.
///
/// The launching process (the caller) numbers its DDP fit() calls 1, 2, ... For call k it writes
/// a checkpoint of the loop ("initial.ckpt": model, optimizer, progress, callbacks' states),
/// starts the ranks with TRAINLOOP_FIT_INDEX=k, waits, and loads the checkpoint rank 0 wrote at
/// the end ("trained.ckpt") into the loop. A rank runs the program from the top: it passes calls
/// 1..k-1 (each loads the state the caller had right after that call and returns its History,
/// so code between fits sees in every rank what the caller saw), trains call k from
/// "initial.ckpt", writes "trained.ckpt", and ends; the rest of the program runs in the caller.
///
/// Files: a session directory per launching process ($TMPDIR/trainloop-session-\<pid\>-XXXXXX,
/// removed when the process exits, or by the next launcher if it was killed) keeps the state
/// after each call (fit\<k\>.ckpt); each launch's run directory lives inside it.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/error_context.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/detail/history_io.hpp>
#include <trainloop/distributed/launcher.hpp>
#include <trainloop/distributed/rank_env.hpp>
#include <trainloop/distributed/run_directory.hpp>
#include <trainloop/distributed/spawned_rank.hpp>
#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <c10/util/Exception.h>
#include <atomic>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <iterator>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <string>
#include <system_error>
#include <unistd.h>
#include <utility>

namespace trainloop::distributed {

namespace env_names {
inline constexpr const char* fit_index = "TRAINLOOP_FIT_INDEX";      ///< the DDP fit() call a spawned rank trains
inline constexpr const char* session_dir = "TRAINLOOP_SESSION_DIR";  ///< the launching process's session directory
inline constexpr const char* restart_count = "TRAINLOOP_RESTART_COUNT";  ///< relaunches so far (0 on the first)
}  // namespace env_names

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

/// How a rank reports a failure: libtorch's message without its backtrace first, the complete
/// text with the backtrace in the full error file, the type for the launcher to rethrow.
inline FailureDescription describe_rank_exception(const std::exception& error) {
  FailureDescription description;
  description.type = ::trainloop::detail::error_type_name(error);
  description.message = ::trainloop::detail::error_text(error);
  description.full_text = ::trainloop::detail::full_error_text(error);
  description.consequence =
      dynamic_cast<const CommunicationError*>(&error) != nullptr || is_peer_failure_text(description.message);
  return description;
}

/// Throws an exception of the type named `type` ("c10::OutOfMemoryError", "trainloop::ConfigurationError",
/// ...) with `message`: libtorch's classes as themselves (without a backtrace: the launcher's own
/// stack would only mislead; the rank's is in its kept error file), trainloop's as themselves,
/// anything else as trainloop::Error. Used to rethrow a rank's failure in the launching process
/// as the class the rank threw, and to replay a failed fit() call in the ranks of a later one.
[[noreturn]] inline void throw_as_type(const std::string& type, const std::string& message) {
  if (type == "c10::OutOfMemoryError") throw c10::OutOfMemoryError(message, {}, nullptr);
  if (type == "c10::IndexError") throw c10::IndexError(message, {}, nullptr);
  if (type == "c10::ValueError") throw c10::ValueError(message, {}, nullptr);
  if (type == "c10::TypeError") throw c10::TypeError(message, {}, nullptr);
  if (type == "c10::NotImplementedError") throw c10::NotImplementedError(message, {}, nullptr);
  if (type.rfind("c10::", 0) == 0) throw c10::Error(message, {}, nullptr);
  if (type == "trainloop::ConfigurationError") throw ConfigurationError(message);
  if (type == "trainloop::CommunicationError") throw CommunicationError(message);
  if (type == "trainloop::RankFailedError") throw RankFailedError(message, {});
  throw Error(message);
}

/// Rethrows a rank's failure so that a libtorch error in a rank reaches the caller as a libtorch
/// error of the same class (`catch (const c10::OutOfMemoryError&)` works in spawn mode too), with
/// the launcher's message and the RankFailedError nested inside; anything else as the
/// RankFailedError itself. Call from the catch block of that RankFailedError.
[[noreturn]] inline void rethrow_rank_failure(const RankFailedError& failure) {
  // std::throw_with_nested nests the exception being handled (the RankFailedError), so it is
  // called here, in the caller's catch block, once per class.
  const std::string& type = failure.details().error_type;
  const std::string message = failure.what();
  if (type == "c10::OutOfMemoryError") std::throw_with_nested(c10::OutOfMemoryError(message, {}, nullptr));
  if (type == "c10::IndexError") std::throw_with_nested(c10::IndexError(message, {}, nullptr));
  if (type == "c10::ValueError") std::throw_with_nested(c10::ValueError(message, {}, nullptr));
  if (type == "c10::TypeError") std::throw_with_nested(c10::TypeError(message, {}, nullptr));
  if (type == "c10::NotImplementedError") std::throw_with_nested(c10::NotImplementedError(message, {}, nullptr));
  if (type.rfind("c10::", 0) == 0) std::throw_with_nested(c10::Error(message, {}, nullptr));
  throw;
}

/// Path of the record of DDP fit() call `fit_index` having failed in the launching process.
inline std::filesystem::path fit_failure_path(const std::filesystem::path& session, int fit_index) {
  return session / (fit_state_name(fit_index) + ".failed");
}

/// The class name the caller of a failed fit() call catches, as throw_as_type() spells it.
inline std::string caught_type(const std::exception& error) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&error)) return "c10::OutOfMemoryError";
  if (dynamic_cast<const c10::IndexError*>(&error)) return "c10::IndexError";
  if (dynamic_cast<const c10::ValueError*>(&error)) return "c10::ValueError";
  if (dynamic_cast<const c10::TypeError*>(&error)) return "c10::TypeError";
  if (dynamic_cast<const c10::NotImplementedError*>(&error)) return "c10::NotImplementedError";
  if (dynamic_cast<const c10::Error*>(&error)) return "c10::Error";
  if (dynamic_cast<const RankFailedError*>(&error)) return "trainloop::RankFailedError";
  if (dynamic_cast<const ConfigurationError*>(&error)) return "trainloop::ConfigurationError";
  if (dynamic_cast<const CommunicationError*>(&error)) return "trainloop::CommunicationError";
  return "trainloop::Error";
}

/// Runs the rank side of a failed fit() call again: throws what the caller caught, so the
/// program takes the same path (a catch that retries with a smaller batch) in every rank.
[[noreturn]] inline void replay_fit_failure(const std::filesystem::path& record) {
  std::ifstream in(record);
  std::string type;
  std::getline(in, type);
  std::string message((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  throw_as_type(type, message);
}

/// In a rank we spawned, an exception that escapes main() (thrown before or after the fit() the
/// rank trains: joining the group, evaluate() before fit()) still reaches the launcher as the
/// rank's own error, not as "killed by SIGABRT".
[[noreturn]] inline void report_uncaught_exception() {
  if (auto error = std::current_exception()) {
    const RankEnv env = [] {
      RankEnv parsed;
      parsed.source = RankEnvSource::Trainloop;
      parsed.run_dir = ::trainloop::distributed::detail::env_string(env_names::run_dir).value_or("");
      if (const char* rank = std::getenv(env_names::rank)) parsed.rank = std::atoi(rank);
      return parsed;
    }();
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& escaped) {
      report_rank_failure(env, describe_rank_exception(escaped));
    } catch (...) {
      report_rank_failure(env, FailureDescription{"unknown", "an exception not derived from std::exception escaped main()",
                                                  "an exception not derived from std::exception escaped main()", false});
    }
    std::fflush(nullptr);
    std::_Exit(1);
  }
  std::abort();  // terminate() for another reason: what the default handler does
}
inline const bool rank_reports_uncaught_exceptions = [] {
  if (std::getenv(env_names::launcher_pid) != nullptr) std::set_terminate(&report_uncaught_exception);
  return true;
}();

}  // namespace detail

/// Options of a spawned fit() beyond the launch itself.
struct SpawnFitOptions {
  int fit_index = 1;     ///< which DDP fit() call of the program this is (1, 2, ...)
  int max_restarts = 0;  ///< relaunches after a rank failure (from the newest checkpoint)
};

/// The launching side of a DDP fit() call: writes the loop's state ("initial.ckpt"), starts the
/// ranks (restarting them all, at most `max_restarts` times, when one fails), waits, and loads
/// the state rank 0 wrote at the end ("trained.ckpt") into the loop, so the caller's model,
/// optimizer, progress and callbacks are what training made of them.
/// @throws RankFailedError (or a libtorch error type, see rethrow_rank_failure) when a rank
///         fails and no restart is left.
inline History launch_spawned_fit(const ::trainloop::detail::FitActions& actions, LaunchOptions options,
                                  const SpawnFitOptions& spawn) {
  const auto session = detail::SpawnSession::instance().directory();
  const int fit_index = spawn.fit_index;
  // A failed call is recorded, so the ranks of a later call replay it (see replay_fit_failure).
  auto record_failure = [&](const std::exception& error) {
    try {
      ::trainloop::detail::write_file_atomically(detail::fit_failure_path(session, fit_index),
                                                 detail::caught_type(error) + "\n" + error.what(),
                                                 "the record of a failed fit()");
    } catch (...) {
    }
  };
  try {
    for (int attempt = 0;; ++attempt) {
      auto env = options.env();
      env[env_names::fit_index] = std::to_string(fit_index);
      env[env_names::session_dir] = session.string();
      env[env_names::restart_count] = std::to_string(attempt);
      LaunchOptions attempt_options = options;
      attempt_options.env(env).run_dir_parent(session.string()).require_completion(true);
      Launcher launcher(attempt_options);
      const std::filesystem::path run_dir = launcher.run_dir();
      actions.save(run_dir / "initial.ckpt", true);
      try {
        launcher.launch();
      } catch (const RankFailedError& failure) {
        if (attempt < spawn.max_restarts) {
          std::cerr << failure.what() << "\ntrainloop: restarting all ranks from the newest checkpoint (restart "
                    << attempt + 1 << " of at most " << spawn.max_restarts << ")" << std::endl;
          continue;
        }
        detail::rethrow_rank_failure(failure);
      }
      History history = actions.load(run_dir / "trained.ckpt");
      // Kept for the ranks of later calls, which pass this one (see the file comment).
      detail::move_file(run_dir / "trained.ckpt", detail::fit_checkpoint_path(session, fit_index));
      return history;
    }
  } catch (const RankFailedError& failure) {
    record_failure(failure);
    throw;
  } catch (const c10::Error& failure) {
    record_failure(failure);
    throw;
  } catch (const Error& failure) {
    record_failure(failure);
    throw;
  }
}

/// The rank side of DDP fit() call `fit_index` in a rank spawned by launch_spawned_fit():
/// - an earlier call than the one this rank was started for: loads the state the caller had
///   after that call (or throws what it threw) and returns its History;
/// - the call this rank was started for: trains from the caller's state ("initial.ckpt"), or
///   from the checkpoint `resume` names (the same program asked for it in every process, or a
///   restart implied "last"), writes the result for the launcher, and ends the process.
template <class Barrier>
History run_spawned_rank_fit(const RankEnv& env, int fit_index, const ::trainloop::detail::FitActions& actions,
                             const ::trainloop::detail::ResumeSpec& resume, Barrier&& barrier) {
  const int wanted = ::trainloop::distributed::detail::env_int(env_names::fit_index, 1).value_or(1);
  const std::filesystem::path session = ::trainloop::distributed::detail::env_string(env_names::session_dir).value_or("");
  if (fit_index < wanted) {
    if (std::filesystem::exists(detail::fit_failure_path(session, fit_index))) {
      detail::replay_fit_failure(detail::fit_failure_path(session, fit_index));
    }
    return actions.load(detail::fit_checkpoint_path(session, fit_index));
  }
  const std::filesystem::path run_dir = env.run_dir;
  const int status = run_reporting_failure(
      env,
      [&] {
        ::trainloop::detail::ResumeSpec from = resume;
        if (from.candidates.empty()) {
          from = ::trainloop::detail::ResumeSpec{{run_dir / "initial.ckpt"}, true, false, "", /*announce=*/false};
        }
        actions.train(from);
        // A collective; each node's local rank 0 writes it for its node's launcher.
        actions.save(run_dir / "trained.ckpt", env.local_rank == 0);
        barrier();  // no rank leaves while another still needs it in a collective
      },
      &detail::describe_rank_exception);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(status);  // the rest of the program runs in the launching process only
}

}  // namespace trainloop::distributed
