#pragma once
/// @file
/// @brief The rank side of DDP in a plain program: a spawned rank passes the fit() calls before
/// the one it was started for, trains that one, reports a failure in words the launcher relays
/// (also an exception escaping main()), and ends (see spawn_relay.hpp).

#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/comm/text_collectives.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/job/replacement.hpp>
#include <trainloop/distributed/launch/failure_report.hpp>
#include <trainloop/distributed/launch/spawned_rank.hpp>
#include <trainloop/distributed/spawn/spawn_session.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <string>
#include <unistd.h>
#include <vector>

namespace trainloop::distributed {

namespace detail {

/// How a rank reports a failure: libtorch's message without its backtrace first, the complete
/// text with the backtrace in the full error file, the type for the launcher to rethrow.
inline FailureDescription describe_rank_exception(const std::exception& error) {
  return describe_exception(error, &::trainloop::detail::error_text, &::trainloop::detail::full_error_text);
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

/// Whether this rank writes the trained state for its launcher (each machine's launcher reads its
/// own copy): the lowest rank of the job's group that this launcher started — its local rank 0,
/// unless elastic training lost that one and went on without it. A collective over the job's group.
inline bool writes_for_its_launcher(const RankEnv& env) {
  ProcessGroup& group = session_group().group;
  if (!group.valid()) return env.local_rank == 0;
  const std::vector<std::string> launchers =
      all_texts(group, ::trainloop::detail::concat(env.launcher_pid, "@", ::trainloop::detail::pid_domain_tag()));
  const auto mine = static_cast<std::size_t>(group.rank());
  for (std::size_t rank = 0; rank < mine; ++rank) {
    if (launchers[rank] == launchers[mine]) return false;
  }
  return true;
}

}  // namespace detail

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
      detail::replay_fit_failure(session, fit_index);
    }
    return actions.load(detail::fit_checkpoint_path(session, fit_index));
  }
  const std::filesystem::path run_dir = env.run_dir;
  const int status = run_reporting_failure(
      env,
      [&] {
        // Every rank starts from one file: the checkpoint `resume` names, else the caller's state.
        // (The DDP engine does not broadcast the model in a spawned rank: this load is the sync.)
        // The caller's state only where the resume allows a fresh start — it found no checkpoint
        // at all — never after candidates it could not read: like single and dp, the fit then
        // fails with the CheckpointError (training on would overwrite the files it could not read).
        ::trainloop::detail::ResumeSpec from = resume;
        if (from.candidates.empty()) {  // resolve_resume() gives none only where a fresh start is allowed
          ::trainloop::detail::say_fresh_start(from, env.rank == 0);
          from = ::trainloop::detail::handed_state(run_dir / "initial.ckpt");
        }
        try {
          actions.train(from);
        } catch (const FitEndedBeforeAdmission&) {
          return;  // a replacement the fit did not need: done, with nothing to write
        }
        // A collective; one rank a launcher writes it for that launcher.
        actions.save(run_dir / "trained.ckpt", detail::writes_for_its_launcher(env));
        barrier();  // no rank leaves while another still needs it in a collective
      },
      &detail::describe_rank_exception);
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
  ::_exit(status);  // the rest of the program runs in the launching process only
}

}  // namespace trainloop::distributed
