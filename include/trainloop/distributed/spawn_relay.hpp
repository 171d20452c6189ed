#pragma once
/// @file
/// @brief DistributedDataParallel in a plain program: fit() re-executes the program once per
/// rank and relays the model, the optimizer and the History between the caller and its ranks.
///
/// The launching process (the caller) numbers its DDP fit() calls 1, 2, ... For call k it saves
/// the model and optimizer ("initial"), starts the ranks with TRAINLOOP_FIT_INDEX=k, waits, and
/// loads the trained state back into the caller's model and optimizer. A rank runs the program
/// from the top: it passes calls 1..k-1 (each returns the History the caller got, and leaves the
/// model and optimizer as the caller had them right after that call, so code between fits sees
/// in every rank what the caller saw), trains call k starting from "initial", writes the result,
/// and ends; the rest of the program runs in the caller only.
///
/// Files: a session directory per launching process ($TMPDIR/trainloop-session-\<pid\>-XXXXXX,
/// removed when the process exits, or by the next launcher if it was killed) keeps the state and
/// History after each call (fit<k>.*); each launch's run directory lives inside it.

#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/history_io.hpp>
#include <trainloop/distributed/launcher.hpp>
#include <trainloop/distributed/rank_env.hpp>
#include <trainloop/distributed/run_directory.hpp>
#include <trainloop/distributed/spawned_rank.hpp>
#include <trainloop/distributed/state_transfer.hpp>
#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <string>
#include <system_error>
#include <unistd.h>
#include <utility>

namespace trainloop::dist {

namespace env_names {
inline constexpr const char* fit_index = "TRAINLOOP_FIT_INDEX";      ///< the DDP fit() call a spawned rank trains
inline constexpr const char* session_dir = "TRAINLOOP_SESSION_DIR";  ///< the launching process's session directory
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
inline std::filesystem::path fit_history_path(const std::filesystem::path& dir, int fit_index) {
  return dir / (fit_state_name(fit_index) + ".history.txt");
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

/// Rethrows a rank's failure so that a libtorch error in a rank reaches the caller as a libtorch
/// error of the same class (`catch (const c10::OutOfMemoryError&)` works in spawn mode too), with
/// the launcher's message and the RankFailedError nested inside; anything else as the
/// RankFailedError itself. Call from the catch block of that RankFailedError.
[[noreturn]] inline void rethrow_rank_failure(const RankFailedError& failure) {
  const std::string& type = failure.details().error_type;
  // No backtrace: the launcher's own stack would only mislead; the rank's is in the kept file.
  const std::string message = failure.what();
  if (type == "c10::OutOfMemoryError") std::throw_with_nested(c10::OutOfMemoryError(message, {}, nullptr));
  if (type == "c10::IndexError") std::throw_with_nested(c10::IndexError(message, {}, nullptr));
  if (type == "c10::ValueError") std::throw_with_nested(c10::ValueError(message, {}, nullptr));
  if (type == "c10::TypeError") std::throw_with_nested(c10::TypeError(message, {}, nullptr));
  if (type == "c10::NotImplementedError") std::throw_with_nested(c10::NotImplementedError(message, {}, nullptr));
  if (type.rfind("c10::", 0) == 0) std::throw_with_nested(c10::Error(message, {}, nullptr));
  throw;
}

}  // namespace detail

/// The launching side of DDP fit() call `fit_index`: starts the ranks (options from the mode),
/// waits, loads the trained state into `module` and `optimizer`, and returns the History.
/// @throws RankFailedError (or a libtorch error type, see rethrow_rank_failure) when a rank fails.
inline History launch_spawned_fit(torch::nn::Module& module, torch::optim::Optimizer& optimizer, LaunchOptions options,
                                  int fit_index) {
  const auto session = detail::SpawnSession::instance().directory();
  auto env = options.env();
  env[env_names::fit_index] = std::to_string(fit_index);
  env[env_names::session_dir] = session.string();
  options.env(env).run_dir_parent(session.string()).require_completion(true);
  Launcher launcher(options);
  const std::filesystem::path run_dir = launcher.run_dir();
  save_training_state(module, optimizer, run_dir, "initial");
  try {
    launcher.launch();
  } catch (const RankFailedError& failure) {
    detail::rethrow_rank_failure(failure);
  }
  load_training_state(module, optimizer, run_dir, "trained");
  History history = ::trainloop::detail::read_history(run_dir / "history.txt");
  // Kept for the ranks of later calls, which pass this one (see the file comment).
  const std::string name = detail::fit_state_name(fit_index);
  std::filesystem::rename(run_dir / "trained.model.pt", session / (name + ".model.pt"));
  std::filesystem::rename(run_dir / "trained.optimizer.pt", session / (name + ".optimizer.pt"));
  std::filesystem::rename(run_dir / "history.txt", detail::fit_history_path(session, fit_index));
  return history;
}

/// The rank side of DDP fit() call `fit_index` in a rank spawned by launch_spawned_fit():
/// - an earlier call than the one this rank was started for: leaves `module` and `optimizer` as
///   the caller had them after that call and returns its History;
/// - the call this rank was started for: `train()` (which loads "initial" as it begins), hands
///   the result to the launcher (local rank 0), waits for every rank, and ends the process.
template <class Train, class Barrier>
History run_spawned_rank_fit(const RankEnv& env, int fit_index, torch::nn::Module& module,
                             torch::optim::Optimizer& optimizer, Train&& train, Barrier&& barrier) {
  const int wanted = ::trainloop::dist::detail::env_int(env_names::fit_index, 1).value_or(1);
  const std::filesystem::path session = ::trainloop::dist::detail::env_string(env_names::session_dir).value_or("");
  if (fit_index < wanted) {
    load_training_state(module, optimizer, session, detail::fit_state_name(fit_index));
    return ::trainloop::detail::read_history(detail::fit_history_path(session, fit_index));
  }
  const int status = run_reporting_failure(
      env,
      [&] {
        History history = train();
        if (env.local_rank == 0) {
          save_training_state(module, optimizer, env.run_dir, "trained");
          ::trainloop::detail::write_history(history, std::filesystem::path(env.run_dir) / "history.txt");
        }
        barrier();  // no rank leaves while another still needs it in a collective
      },
      &detail::describe_rank_exception);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(status);  // the rest of the program runs in the launching process only
}

}  // namespace trainloop::dist
