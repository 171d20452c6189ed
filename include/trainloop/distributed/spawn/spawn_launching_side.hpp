#pragma once
/// @file
/// @brief The launching side of DDP in a plain program: fit() writes the loop's state, starts the
/// ranks (restarting them on failure if asked), waits, and loads the state rank 0 wrote (see
/// spawn_relay.hpp).

#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/launch/launcher.hpp>
#include <trainloop/distributed/spawn/relayed_exceptions.hpp>
#include <trainloop/distributed/spawn/spawn_session.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <c10/util/Exception.h>

#include <filesystem>
#include <iostream>
#include <set>
#include <string>

namespace trainloop::distributed {

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
  auto record_failure = [&](const std::exception& error) { detail::record_fit_failure(session, fit_index, error); };
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
      std::set<int> lost;  // elastic training: the ranks of this launcher the job went on without
      try {
        for (const RankProcess& process : launcher.launch()) {
          if (process.lost) lost.insert(process.rank);
        }
      } catch (const RankFailedError& failure) {
        if (attempt < spawn.max_restarts) {
          std::cerr << failure.what() << "\ntrainloop: restarting all ranks from the newest checkpoint (restart "
                    << attempt + 1 << " of at most " << spawn.max_restarts << ")" << std::endl;
          continue;
        }
        detail::rethrow_rank_failure(failure);
      }
      // On several machines the job may go on without every rank this launcher started, or without a
      // spare machine's replacements that were never admitted: this machine then has nothing to return.
      if ((!lost.empty() || options.joins_running_fit()) && !std::filesystem::exists(run_dir / "trained.ckpt")) {
        std::string why;
        if (!lost.empty()) {
          std::string ranks;
          for (const int rank : lost) ranks += (ranks.empty() ? "" : ", ") + std::to_string(rank);
          why = ::trainloop::detail::concat("every rank this launcher started was lost (", ranks, ") and no replacement of "
                                            "theirs was in the job when the fit ended: the job went on without them on the "
                                            "other machines");
        } else {
          why = "this machine's ranks started as replacements in the job's running fit, and none was admitted before the "
                "fit ended (it needed no replacement, or its last steps passed while they started)";
        }
        throw Error(::trainloop::detail::concat("trainloop: ", why, "; this machine holds no trained state; expected a rank "
                                                "of this machine in the job at the fit's end (max_replacements, docs/elastic.md)"));
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

}  // namespace trainloop::distributed
