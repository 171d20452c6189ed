#pragma once
/// @file
/// @brief The survivors of a lost rank form a new process group in place of the job's group
/// (comm/rank_session.hpp's), without a restart: they agree who is left (membership.hpp), the
/// old group is parked, never destroyed — an operation of it may still be blocked in Gloo's
/// worker thread until its timeout, and destroying the group would join that thread — and the
/// new group forms over the same store under a fresh prefix, the survivors renumbered in their
/// old order (old rank 0, which holds the store, stays rank 0). The stall watchdog and the
/// collective log start again with the new group.
///
/// NCCL is not handled here: its communicator must be aborted and re-created (ncclCommAbort), which
/// this release does not do; elastic training runs over Gloo (gpu_mode/multi_process.hpp says so).

#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/abandonable_wait.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/elastic/membership.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/failure_report.hpp>
#include <trainloop/distributed/watch/watchdog_start.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace trainloop::distributed::elastic {

/// What a regroup made of this rank.
struct Regrouped {
  Membership membership;  ///< the decision (old ranks)
  int old_rank = 0;       ///< this rank before
  int old_world = 0;      ///< ranks before
  int holder_rank = 0;    ///< the new rank of the process that holds the committed step's state
};

namespace detail {

/// The groups of earlier generations: kept alive until the process ends (see the file comment).
inline std::vector<ProcessGroup>& parked_groups() {
  static auto* parked = new std::vector<ProcessGroup>();  // never destroyed, on purpose
  return *parked;
}

/// The generation of the job's group: 0 for the first, +1 per regroup (kept with the progress, where
/// the test kill plans read it: progress/test_kill_point.hpp).
inline std::atomic<int>& generation() { return progress::group_generation(); }

/// Waits of the job's group give up once a survivor asked for it in the group's generation.
inline void install_probe_for(const ProcessGroup& group, int generation_number) {
  install_abandon_probe([store = group.job_store(), keys = GenerationKeys(generation_number)] {
    try {
      return abandon_requested(*store, keys);
    } catch (const std::exception&) {
      return true;  // the store is gone (rank 0 lost): nothing this group waits for will come
    }
  });
}

/// The store prefix of generation `generation`'s group.
inline std::string generation_group_prefix(int generation) { return "trainloop-elastic/g" + std::to_string(generation) + "/group"; }

/// The job's group (`session`'s) becomes the next generation's, `world` ranks of which this process
/// is `rank`, made over `old`'s store; `old` is parked (see the file comment). The caller holds
/// the session's mutex. `rendezvous_timeout` (0: the group's timeout) bounds the wait for the
/// others (ProcessGroupOptions::rendezvous_timeout). (A replacement joins the same group with
/// ProcessGroup::create: replacement_join.hpp.)
/// @throws trainloop::CommunicationError when the rendezvous fails; the generation is used up then
///         and the job's group is still `old`.
inline void next_generation_group(::trainloop::distributed::detail::SessionGroup& session, const ProcessGroup& old, int rank,
                                  int world, const RankEnv& env,
                                  std::chrono::milliseconds rendezvous_timeout = std::chrono::milliseconds(0)) {
  ++generation();
  ProcessGroupOptions options = session.options;
  options.rank = rank;
  options.world_size = world;
  options.rendezvous_timeout = rendezvous_timeout;
  options.store_prefix = generation_group_prefix(generation().load());
  options.is_store_server = false;  // the store lives on in old rank 0's parked group
  parked_groups().push_back(old);
  session.group = old.regroup(options);
  session.group.log_collectives();
  session.options = options;
  publish_identity(*old.job_store(), GenerationKeys(generation().load()), rank);
  install_probe_for(session.group, generation().load());
  restart_stall_watchdog(options, env);
}

}  // namespace detail

/// Makes the job's group elastic (once per process): its waits can be abandoned, and this
/// process's identity is in the store, so that a survivor can tell it is gone.
inline void make_job_group_elastic(ProcessGroup& group) {
  static std::once_flag once;
  std::call_once(once, [&] {
    publish_identity(*group.job_store(), GenerationKeys(detail::generation().load()), group.rank());
    detail::install_probe_for(group, detail::generation().load());
  });
}

/// A collective of the job's group failed here: every survivor's waits give up, this rank reports
/// `committed_step`, old rank 0 decides who goes on, and the members form the next generation's
/// group, which replaces the job's group (rank_session.hpp). `wait_for_remote`: how long a rank
/// of another machine has to report before it counts as lost.
/// @return nothing when every rank reported alive (the failure was something else: the caller
///         rethrows it).
/// @throws trainloop::CommunicationError when rank 0 was lost, or when this rank was left out.
inline std::optional<Regrouped> regroup_job(const RankEnv& env, std::int64_t committed_step, std::chrono::milliseconds wait_for_remote) {
  auto& session = ::trainloop::distributed::detail::session_group();
  std::lock_guard<std::mutex> lock(session.mutex);
  ProcessGroup old = session.group;
  const GenerationKeys keys(detail::generation().load());
  ::c10d::Store& store = *old.job_store();
  Regrouped result;
  result.old_rank = old.rank();
  result.old_world = old.world_size();
  try {
    request_abandon(store, keys);
    report_alive(store, keys, old.rank(), committed_step);
    if (old.rank() == 0) {
      result.membership = decide_membership(store, keys, old.world_size(), wait_for_remote, [&](int rank) {
        // The launcher's ranks leave their error in its run directory; a killed one leaves none.
        if (!env.run_dir.empty()) {
          const RankErrorReport report = read_rank_error(env.run_dir, rank);
          if (report.present) return "it failed: " + report.message.substr(0, report.message.find('\n'));
        }
        return std::string("its process ended without a word (killed: SIGKILL, out of memory, or its machine)");
      });
    } else {
      // Old rank 0 decides within wait_for_remote of its own report; a margin for its own way there.
      result.membership = read_membership(store, keys, wait_for_remote + std::chrono::seconds(30));
    }
  } catch (const c10::Error& error) {
    throw CommunicationError(::trainloop::detail::concat(
        "trainloop: rank ", old.rank(), " lost the job's store while its group regrouped after a lost rank: rank 0, "
        "whose process holds the store, is gone too, and the job cannot go on. Details: ", error.what_without_backtrace()));
  }
  const Membership& m = result.membership;
  if (m.lost.empty()) return std::nullopt;  // every rank reported: the failure was not a lost rank
  const auto self = std::find(m.members.begin(), m.members.end(), old.rank());
  if (self == m.members.end()) {
    throw CommunicationError(::trainloop::detail::concat(
        "trainloop: rank ", old.rank(), " was counted as lost by the other ranks (it did not report within ",
        wait_for_remote.count(), " ms) and the job went on without it; this process ends"));
  }
  TRAINLOOP_CHECK(std::find(m.members.begin(), m.members.end(), 0) != m.members.end(),
                  "the elastic decision leaves out rank 0; expected rank 0, which holds the store, among the members");
  detail::next_generation_group(session, old, static_cast<int>(self - m.members.begin()), static_cast<int>(m.members.size()), env);
  result.holder_rank = static_cast<int>(std::find(m.members.begin(), m.members.end(), m.holder) - m.members.begin());
  return result;
}

}  // namespace trainloop::distributed::elastic
