#pragma once
/// @file
/// @brief A replacement process joins the running job's group (admission.hpp has the protocol):
/// at a step boundary the members agreed on, rank 0 admits the replacements that wait and are
/// alive, and the members and the replacements form the next generation's group — the members in
/// their order, the replacements after them — over the job's store, as after a loss
/// (regroup.hpp). What they resume from is elastic_fit.hpp's.

#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/comm/store_text.hpp>
#include <trainloop/distributed/elastic/admission.hpp>
#include <trainloop/distributed/elastic/membership.hpp>
#include <trainloop/distributed/elastic/regroup.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/job/replacement.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <chrono>
#include <cstdint>
#include <exception>
#include <iostream>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace trainloop::distributed::elastic {

/// What admitting replacements made of the group.
struct Grown {
  GrowDecision decision;  ///< the replacements admitted, and how the state goes to them
  int old_world = 0;      ///< ranks before
  /// Why the grown group did not form (a replacement lost between its admission and the group's
  /// rendezvous): the members formed their own group again and go on without the replacements.
  /// Empty when it formed.
  std::string not_formed;
};

/// On every member, at the boundary its ranks agreed on: rank 0 admits up to `waiting`
/// replacements (`watch`: its queue; null elsewhere), telling them the step `step` the group
/// resumes from and where its state is (`hand_offs_for(joined)`: a file or directory each, or all
/// empty when it comes over the new group), and every member joins the next generation's group
/// with them.
/// None may be left to admit (the ones that waited died since): the group is then formed again
/// without newcomers. The rendezvous waits at most `rendezvous_timeout` for the replacements; when
/// a member could not form the grown group, every member forms its own group again (the next
/// generation, without the replacements: Grown::not_formed says why).
/// @throws trainloop::CommunicationError when rank 0's decision does not come (rank 0 lost).
template <class HandOffsFor>
Grown grow_job(const RankEnv& env, JoinWatch* watch, std::int64_t waiting, std::int64_t step, HandOffsFor&& hand_offs_for,
               std::chrono::milliseconds timeout, std::chrono::milliseconds rendezvous_timeout) {
  auto& session = ::trainloop::distributed::detail::session_group();
  std::lock_guard<std::mutex> lock(session.mutex);
  const ProcessGroup old = session.group;
  ::c10d::Store& store = *old.job_store();
  Grown grown;
  grown.old_world = old.world_size();
  const int generation = detail::generation().load();
  if (old.rank() == 0) {
    TRAINLOOP_CHECK(watch != nullptr, "rank 0 admits replacements without its queue; expected the engine's JoinWatch");
    grown.decision.joined = watch->take(store, waiting);
    const std::vector<std::string> hand_offs = hand_offs_for(grown.decision.joined);
    write_admissions(store, generation, grown.old_world, grown.decision.joined, step, hand_offs);
    grown.decision.over_group = !hand_offs.empty() && hand_offs.front().empty();
  } else {
    grown.decision = read_admissions(store, generation, timeout);
  }
  const int world = grown.old_world + static_cast<int>(grown.decision.joined.size());
  std::string failure;
  try {
    detail::next_generation_group(session, old, old.rank(), world, env, rendezvous_timeout);
  } catch (const CommunicationError& error) {
    failure = error.what();
    failure = failure.substr(0, failure.find('\n'));
  }
  const int grown_generation = detail::generation().load();
  grown.not_formed = agree_on_growth(store, grown_generation, old.rank(), grown.old_world, failure, timeout);
  if (grown.not_formed.empty()) return grown;
  if (failure.empty()) detail::parked_groups().push_back(session.group);  // formed here, not everywhere
  detail::next_generation_group(session, old, old.rank(), grown.old_world, env);
  grown.decision.over_group = false;  // every member holds the state it resumes from
  return grown;
}

namespace detail {

/// A client connection to the job's store at `master_addr`:`master_port`, within 5 s; null when
/// none answers there (a store that is gone: rank 0's process, which holds it, ended).
inline c10::intrusive_ptr<::c10d::Store> reach_job_store(const std::string& master_addr, int master_port) {
  ProcessGroupOptions reach;
  reach.rank = 1;  // only to reach the store as a client
  reach.world_size = 2;
  reach.master_addr = master_addr;
  reach.master_port = master_port;
  reach.is_store_server = false;
  reach.timeout = std::chrono::seconds(5);
  try {
    return connect_store(reach);
  } catch (const CommunicationError&) {
    return {};
  }
}

}  // namespace detail

/// On a machine's launching process (node rank > 0) before it starts its ranks for the program's
/// fit() call `fit_index`: whether the job at `master_addr`:`master_port` is training that call
/// already and admits replacements (rank 0 set join_keys::admitting(), and not `closed`). Then this
/// machine stands in for a lost one: its ranks join as replacements (LaunchOptions::joins_running_fit).
/// False when nothing listens there yet, or the job's ranks have not begun the fit: a machine
/// starting with the others meets them at the fit's start. Costs a connection attempt (at most
/// a second when nothing answers) and, when the store answers, two lookups.
/// @throws trainloop::ConfigurationError when the job trains another fit() call of the program
///         (this machine's program must reach the call the job is in).
inline bool running_fit_admits(const std::string& master_addr, int master_port, int fit_index) {
  if (probe_connection(master_addr, master_port, std::chrono::seconds(1)) != ConnectProbe::Accepted) return false;
  std::string running;
  try {
    const c10::intrusive_ptr<::c10d::Store> store = detail::reach_job_store(master_addr, master_port);
    if (!store) return false;
    if (!store->check({join_keys::admitting()}) || store->check({join_keys::closed()})) return false;
    running = distributed::detail::store_text(store->get(join_keys::admitting()));
  } catch (const std::exception&) {
    return false;  // no store of ours answered there (rank 0 not up yet, or another program's port)
  }
  TRAINLOOP_CHECK(running == std::to_string(fit_index), "the job at ", master_addr, ":", master_port,
                  " is training its fit() call ", running, " and this machine's program is at call ", fit_index,
                  "; expected the same call: a machine that stands in for a lost one joins the fit the job is in");
  return true;
}

/// In a replacement (awaiting_admission()): asks to join, waits until rank 0 admits it, and joins
/// the group it is admitted to (`options`: the engine's backend, device and timeout; its rendezvous
/// waits at most `rendezvous_timeout`, as the members'). Returns the admission; nothing when the fit
/// ended before it was admitted (or before it could ask), or when the grown group did not form on
/// every member (they go on without it: grow_job).
inline std::optional<Admission> join_as_replacement(const RankEnv& env, ProcessGroupOptions options,
                                                    std::chrono::milliseconds timeout, std::chrono::milliseconds rendezvous_timeout) {
  options.rank = env.rank;  // only to reach the store as a client
  options.world_size = env.world_size;
  options.master_addr = env.master_addr;
  options.master_port = env.master_port;
  options.is_store_server = false;
  // The store lives as long as rank 0's process: nothing listening means the job is over (a
  // replacement started as the fit ended; or rank 0 was lost, which its launcher reports).
  const c10::intrusive_ptr<::c10d::Store> store = detail::reach_job_store(env.master_addr, env.master_port);
  if (!store) return std::nullopt;
  const std::int64_t ticket = ask_to_join(*store, env.rank);
  std::optional<Admission> admission = wait_for_admission(*store, ticket);
  if (!admission) return std::nullopt;
  auto& session = ::trainloop::distributed::detail::session_group();
  std::lock_guard<std::mutex> lock(session.mutex);
  detail::generation() = admission->generation;
  progress::test_kill_point(progress::KillPoint::Join, admission->step + 1);  // (after: a plan may name the generation)
  options.rank = admission->rank;
  options.world_size = admission->world_size;
  options.store_prefix = detail::generation_group_prefix(admission->generation);
  options.rendezvous_timeout = rendezvous_timeout;
  ProcessGroup group;
  std::string failure;
  try {
    group = ProcessGroup::create_over(store, options);  // the connection it asked through
  } catch (const CommunicationError& error) {
    failure = error.what();
  }
  const std::string not_formed = verdict_of_growth(*store, admission->generation, timeout);
  if (!not_formed.empty()) {
    if (group.valid()) detail::parked_groups().push_back(group);  // the members left it
    std::cerr << "trainloop: this replacement for rank " << env.rank << " was admitted, but the grown group did not form ("
              << not_formed << "); the job goes on without it and this process ends\n";
    return std::nullopt;
  }
  TRAINLOOP_CHECK(failure.empty(), "the grown group formed on every member but not in this replacement (", failure,
                  "); expected the same rendezvous everywhere");
  options.rendezvous_timeout = std::chrono::milliseconds(0);
  session.group = group;
  session.group.log_collectives();
  session.options = options;
  publish_identity(*session.group.job_store(), GenerationKeys(admission->generation), admission->rank);
  detail::install_probe_for(session.group, admission->generation);
  awaiting_admission() = false;
  // Its collectives until the resume are logged at the members' step (the stall watchdog compares them).
  progress::progress_beacon().set_global_step(admission->step);
  return admission;
}

}  // namespace trainloop::distributed::elastic
