#pragma once
/// @file
/// @brief A fit that survives the loss of a rank (gpu_mode's elastic(true)): the loop's fit runs;
/// when a collective fails because a rank was lost, the survivors regroup (regroup.hpp) and resume
/// from the newest committed step (step_committer.hpp) with the new world size — as a run that
/// changed its world size at that step on purpose resumes from its checkpoint, so the result is
/// that run's, and every sample of the epoch is counted once. The step in flight is redone by the
/// survivors; no committed step is lost. Replicated state that every survivor committed stays in
/// place: each writes the loop's state alone (streams, sums, progress: a few KB) and keeps its
/// model and optimizer; survivors a step apart get the holder's whole state over the new group;
/// sharded state is rebuilt from the copies (sharded_hand_off.hpp).
///
/// The hand-off passes through a file in memory (/dev/shm where there is one, else the run
/// directory): the loop resumes from a checkpoint archive. A hand-off stays while a second loss may
/// need it (PendingHandOff: replicated, until the next commit; sharded, until every survivor's
/// copies hold a later step): a second loss before then resumes from it again. Nothing is read from the job's
/// checkpoints. Before any step of the fit was committed, the survivors start the fit again from
/// where it started (the caller's state, or the checkpoint it resumed).
///
/// Replacements (replacement_join.hpp): at the step boundary the ranks agreed on, every member
/// leaves the fit (ReplacementsJoin), the group grows by the replacements admitted, and every rank
/// — the replacements too, which enter here before their fit trains — resumes from the step
/// committed last with the grown world size, handed over from memory.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/comm/text_collectives.hpp>
#include <trainloop/distributed/elastic/admission.hpp>
#include <trainloop/distributed/elastic/elastic_fit_parts.hpp>
#include <trainloop/distributed/elastic/hand_off_file.hpp>
#include <trainloop/distributed/elastic/machine_directory.hpp>
#include <trainloop/distributed/elastic/pending_hand_off.hpp>
#include <trainloop/distributed/elastic/regroup.hpp>
#include <trainloop/distributed/elastic/replacement_join.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/elastic/sharded_hand_off.hpp>
#include <trainloop/distributed/elastic/step_committer.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/job/replacement.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/error.hpp>
#include <trainloop/history.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <iterator>
#include <optional>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace trainloop::distributed::elastic {

namespace detail {

/// Whether `error` may be the consequence of a lost rank (what a survivor's collective raises).
inline bool may_be_a_lost_rank(const std::exception& error) {
  return dynamic_cast<const CommunicationError*>(&error) != nullptr || dynamic_cast<const DesyncError*>(&error) != nullptr;
}

}  // namespace detail

/// After a lost rank: regroup, hand the committed state to every survivor, and return what the
/// fit resumes from; nothing when no rank was lost (the caller rethrows its error).
inline std::optional<::trainloop::detail::ResumeSpec> recover_from_lost_rank(const ::trainloop::detail::FitActions& actions,
                                                                           const ::trainloop::detail::ResumeSpec& start,
                                                                           const ElasticFitParts& parts, PendingHandOff& pending) {
  const auto began = std::chrono::steady_clock::now();
  ShareCopies* copies = parts.share_copies ? parts.share_copies() : nullptr;
  // Nothing committed since the last hand-off was loaded (sharded state: no copies taken since), so
  // the state this rank holds is that hand-off's step: it is kept (PendingHandOff) for this.
  const bool holds_pending = pending.step() >= 0 && (copies ? pending.sharded() && copies->newest_step() < 0
                                                           : !pending.sharded() && parts.commits->committed_step() < 0);
  // Sharded state: the newest step whose copies this rank holds whole; otherwise the newest commit.
  const std::int64_t held = holds_pending ? pending.step() : copies ? copies->newest_step() : parts.commits->committed_step();
  std::optional<Regrouped> regrouped = regroup_job(*parts.env, held, parts.elastic_wait);
  if (!regrouped) return std::nullopt;
  ProcessGroup& group = ::trainloop::distributed::detail::session_group().group;
  const Membership& m = regrouped->membership;
  ::trainloop::detail::ResumeSpec next = start;
  next.announce = false;
  // Every survivor: the step in flight's gradients go (a rebuilt reducer would keep them); the
  // holder's buffers are the committed ones again before it writes them.
  parts.put_back_committed_state();
  const std::int64_t resumed_step = copies ? m.oldest_step : m.committed_step;
  // A kept sharded hand-off's remover may be the rank just lost: each machine's lowest survivor
  // that holds it removes it now (a collective of every survivor of sharded state).
  if (copies) pending.held_for_machine(lowest_on_machine_knowing(group, pending.sharded() ? pending.path() : ""));
  // Sharded state whose oldest step is the kept hand-off's: a survivor took no copies since it (a
  // second loss in the first step after a recovery or an admission), and every survivor still holds
  // that hand-off (none committed the second step after it: PendingHandOff). They read it again.
  const bool again = copies && m.oldest_step >= 0 && pending.sharded() && m.oldest_step == pending.step();
  if (again) {
    next = ::trainloop::detail::handed_state(pending.path());
    next.removes_directory = pending.removes();
    pending.keep(next, m.oldest_step, *parts.commits);
  } else if (copies && m.oldest_step >= 0) {
    // The step every survivor holds, from their copies (the lost ranks' shards from their keepers').
    const MachineDirectory directory = write_sharded_hand_off(
        group, *copies, m, regrouped->old_rank, regrouped->old_world, *parts.env,
        ::trainloop::distributed::elastic::detail::generation().load(), parts.state_bytes_or_zero());
    next = ::trainloop::detail::handed_state(directory.path);
    next.removes_directory = directory.lead;  // each machine's copy, by its lead
    pending.keep(next, m.oldest_step, *parts.commits);  // until every survivor's copies hold a later step
  } else if (!copies && m.committed_step >= 0) {
    const int generation = ::trainloop::distributed::elastic::detail::generation().load();
    // That step is the kept hand-off's (a second loss before the next commit): its file is the state.
    const bool from_pending = holds_pending && m.committed_step == pending.step();
    // (TRAINLOOP_TEST_ELASTIC_SHARE: tests take the path of survivors a step apart, which timing decides.)
    if (m.all_committed && std::getenv("TRAINLOOP_TEST_ELASTIC_SHARE") == nullptr) {
      // Every survivor committed that step: each holds its weights and optimizer state as the step
      // left them (replicated, the same on every rank) and the commit's streams and sums. So each
      // keeps its model and optimizer where they are and writes only the loop's state (a few KB):
      // nothing travels, nothing of the model's size is written or read (the 100 M MLP's 1.2 GB
      // archive took seconds to write and load again: benchmarks/README.md, "elastic_recovery").
      const std::filesystem::path file =
          from_pending ? pending.path() : detail::hand_off_path(*parts.env, generation, detail::kLoopStateBytes);
      next = ::trainloop::detail::handed_state(file);
      next.keeps_model_and_optimizer = !from_pending || pending.keeps_model_and_optimizer();
      if (!from_pending) actions.save_committed_loop_state(file);
      // Until the next commit, a loss puts back that step's buffers from memory (the file has none).
      if (next.keeps_model_and_optimizer) parts.hold_committed_buffers();
    } else {
      // Survivors a step apart: the holder's whole state goes to every survivor over the new group.
      auto write_state = [&](const std::filesystem::path& path) {
        if (!from_pending) return actions.save_committed(path);
        // A kept hand-off of the loop's state alone is every survivor's (they all hold its step).
        TRAINLOOP_CHECK(!pending.keeps_model_and_optimizer(), "the kept hand-off ", pending.path().string(),
                        " holds the loop's state alone; expected every survivor to hold its step ", pending.step());
        std::error_code not_linked;  // a link where the file system allows one, else a copy
        std::filesystem::create_hard_link(pending.path(), path, not_linked);
        if (not_linked) std::filesystem::copy_file(pending.path(), path, std::filesystem::copy_options::overwrite_existing);
      };
      const std::filesystem::path file = detail::share_file(
          group, regrouped->holder_rank, parts.state_bytes_or_zero(),
          [&](std::uintmax_t bytes) { return detail::hand_off_path(*parts.env, generation, bytes); }, write_state);
      next = ::trainloop::detail::handed_state(file);
    }
    pending.keep(next, m.committed_step, *parts.commits);
  } else {
    pending.drop();  // the fit starts again from its start
  }
  // The step in flight: after the newest commit (sharded state: this rank's, its copies may be older;
  // none yet in this fit: the step of the hand-off it resumed from).
  const std::int64_t own_commit = parts.commits->committed_step();
  const std::int64_t in_flight = (copies ? (own_commit >= 0 ? own_commit : held) : m.committed_step) + 1;
  if (group.rank() == 0) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    std::ostringstream line;
    for (const LostRank& lost : m.lost) {
      line << "trainloop: rank " << lost.rank << " (pid " << lost.pid << ") lost at step " << in_flight << ": "
           << lost.cause << "; continuing with " << group.world_size() << " rank" << (group.world_size() == 1 ? "" : "s")
           << " (regrouped in " << std::fixed << std::setprecision(2) << seconds * 1000.0 << " ms, "
           << (resumed_step < 0 ? std::string("from the fit's start: no step was committed")
               : again         ? ::trainloop::detail::concat("from step ", resumed_step,
                                                             " again: the hand-off every survivor kept since it")
               : copies        ? ::trainloop::detail::concat("from step ", resumed_step, " held by rank ",
                                                             (lost.rank + regrouped->old_world - 1) % regrouped->old_world,
                                                             "'s copy of its shards and the survivors' own")
                               : ::trainloop::detail::concat("from step ", resumed_step, " held by rank ", m.holder))
           << ")\n";
    }
    std::cerr << line.str() << std::flush;
  }
  return next;
}

/// What a rank resumes from after an admission: `hand_off` (a file or directory in this machine's
/// memory; `removes_it`: this rank removes the directory once every rank read it), or, when
/// `over_group` (a replacement on another machine), what the grown group `group` hands it — the
/// loop's state sent from rank 0 (replicated), or each machine's whole copy of the members'
/// per-rank checkpoint (sharded: machine_directory.hpp; a collective of every rank). Which of the
/// two is rank 0's `sharded` (the members wrote their copies; a replacement cannot know).
inline ::trainloop::detail::ResumeSpec admission_hand_off(const ::trainloop::detail::FitActions& actions, ProcessGroup& group,
                                                          bool over_group, const std::string& hand_off, bool removes_it,
                                                          bool sharded, bool loop_state_only, const ElasticFitParts& parts) {
  std::filesystem::path file = hand_off;
  const int generation = ::trainloop::distributed::elastic::detail::generation().load();
  if (over_group) sharded = broadcast_text(group, sharded ? "1" : "0", 0) == "1";
  if (over_group && sharded) {
    // The members' copies are whole on their machines; a machine without one gets one.
    std::exception_ptr failure;
    const MachineDirectory directory = machine_directory(group, *parts.env, hand_off,
                                                         ::trainloop::detail::concat(::getpid(), "-g", generation, ".dcp"),
                                                         parts.state_bytes_or_zero(), failure);
    file = complete_every_copy(group, directory, failure, "trainloop: the sharded state could not be handed to the replacements");
    removes_it = directory.lead;
  } else if (over_group) {
    if (!file.empty()) std::filesystem::remove(file);  // the one sent replaces it
    file = detail::share_file(
        group, 0, parts.state_bytes_or_zero(),
        [&](std::uintmax_t bytes) { return detail::hand_off_path(*parts.env, generation, bytes); },
        [&](const std::filesystem::path& path) { actions.save_committed(path); });
  }
  ::trainloop::detail::ResumeSpec next = ::trainloop::detail::handed_state(file);
  next.consume = true;
  next.removes_directory = removes_it;
  next.keeps_model_and_optimizer = loop_state_only && !over_group;  // over the group: the state sent replaced it
  if (next.keeps_model_and_optimizer) parts.hold_committed_buffers();
  return next;
}

/// On every member at the step boundary its ranks agreed on (ReplacementsJoin): the group grows by
/// the replacements rank 0 admits, and every rank resumes from the step committed last with the
/// new world size — as a run that changed its world size at that step on purpose. Each member
/// writes that step from its own state (sharded: its copies, as one per-rank checkpoint; replicated:
/// its own hand-off, the same on every member) and nothing travels to it; a replacement on this
/// machine reads rank 0's (replicated: a link to rank 0's file, its own to consume); when one runs
/// on another machine, the grown group hands the state on (admission_hand_off).
inline ::trainloop::detail::ResumeSpec admit_replacements(const ::trainloop::detail::FitActions& actions,
                                                          const ReplacementsJoin& join, const ElasticFitParts& parts,
                                                          PendingHandOff& pending) {
  const auto began = std::chrono::steady_clock::now();
  ShareCopies* copies = parts.share_copies ? parts.share_copies() : nullptr;
  const std::int64_t step = copies ? copies->newest_step() : parts.commits->committed_step();
  const int generation = ::trainloop::distributed::elastic::detail::generation().load();
  parts.put_back_committed_state();
  std::string own;  // what this member resumes from
  bool removes_own = false;  // sharded: this member removes its machine's copy once every rank read it
  if (copies) {  // every member holds its own copies of that step: nobody was lost
    ProcessGroup& old = ::trainloop::distributed::detail::session_group().group;
    Membership all;
    for (int rank = 0; rank < old.world_size(); ++rank) all.members.push_back(rank);
    all.committed_step = all.oldest_step = step;
    all.all_committed = true;
    const MachineDirectory directory = write_sharded_hand_off(old, *copies, all, old.rank(), old.world_size(), *parts.env,
                                                              ::trainloop::distributed::elastic::detail::generation().load(),
                                                              parts.state_bytes_or_zero());
    own = directory.path.string();
    removes_own = directory.lead;
  } else {  // every member committed that step and holds its weights and optimizer state: the loop's state alone
    own = detail::hand_off_path(*parts.env, generation, detail::kLoopStateBytes).string();
    actions.save_committed_loop_state(own);
  }
  // On rank 0: where each replacement finds the state (all empty: one is on another machine).
  // Replicated state on this machine: rank 0's whole state, written once, a link for each.
  std::filesystem::path whole;
  std::vector<std::filesystem::path> links;  // rank 0's links for the replacements (each consumes its own)
  auto hand_offs_for = [&](const std::vector<JoinRequest>& joining) {
    const bool local = std::all_of(joining.begin(), joining.end(), [](const JoinRequest& r) { return r.on_this_machine(); });
    std::vector<std::string> hand_offs;
    for (const JoinRequest& request : joining) {
      if (copies || !local) {  // sharded state on this machine: every replacement reads rank 0's copy
        hand_offs.push_back(copies && local ? own : std::string());
        continue;
      }
      if (whole.empty()) {
        whole = detail::hand_off_path(*parts.env, generation, parts.state_bytes_or_zero(), "-whole");
        actions.save_committed(whole);
      }
      const std::string link = ::trainloop::detail::concat(whole.string(), ".t", request.ticket);
      std::filesystem::create_hard_link(whole, link);
      links.emplace_back(link);
      hand_offs.push_back(link);
    }
    return hand_offs;
  };
  const Grown grown = grow_job(*parts.env, parts.join_watch, join.waiting(), step, hand_offs_for,
                               parts.elastic_wait + std::chrono::seconds(30), parts.elastic_wait);
  std::error_code ignored;
  if (!whole.empty()) std::filesystem::remove(whole, ignored);  // the replacements hold their links
  if (!grown.not_formed.empty()) {
    for (const std::filesystem::path& link : links) std::filesystem::remove(link, ignored);  // nobody reads them now
  }
  ProcessGroup& group = ::trainloop::distributed::detail::session_group().group;
  ::trainloop::detail::ResumeSpec next = admission_hand_off(actions, group, grown.decision.over_group, own, removes_own,
                                                            /*sharded=*/copies != nullptr, /*loop_state_only=*/copies == nullptr,
                                                            parts);
  pending.keep(next, step, *parts.commits);
  if (group.rank() == 0) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    std::ostringstream line;
    const std::vector<JoinRequest>& joined = grown.decision.joined;
    for (std::size_t i = 0; i < joined.size() && !grown.not_formed.empty(); ++i) {
      line << "trainloop: the replacement for rank " << joined[i].launcher_rank << " (pid " << joined[i].pid()
           << ") admitted at step " << step + 1 << " was lost before the grown group formed (" << grown.not_formed
           << "); continuing with " << group.world_size() << " rank" << (group.world_size() == 1 ? "" : "s") << " (in "
           << std::fixed << std::setprecision(2) << seconds * 1000.0 << " ms, from step " << step << ")\n";
    }
    for (std::size_t i = 0; i < joined.size() && grown.not_formed.empty(); ++i) {
      line << "trainloop: a replacement for rank " << joined[i].launcher_rank << " (pid " << joined[i].pid()
           << ") joined at step " << step + 1 << " as rank " << grown.old_world + static_cast<int>(i) << "; continuing with "
           << group.world_size() << " ranks (admitted in " << std::fixed << std::setprecision(2) << seconds * 1000.0
           << " ms, from step " << step << " held by the " << grown.old_world << " rank" << (grown.old_world == 1 ? "" : "s")
           << " before it)\n";
    }
    if (joined.empty()) {
      line << "trainloop: the replacements that asked to join at step " << step + 1 << " ended first; continuing with "
           << group.world_size() << " ranks\n";
    }
    std::cerr << line.str() << std::flush;
  }
  return next;
}

/// In a replacement, before its fit trains: joins the running fit when the members admit it and
/// returns what it resumes from (the step they resume from, handed over); throws
/// FitEndedBeforeAdmission when the fit ended first.
inline ::trainloop::detail::ResumeSpec join_running_fit(const ::trainloop::detail::FitActions& actions,
                                                        const ElasticFitParts& parts, PendingHandOff& pending) {
  std::optional<Admission> admission =
      join_as_replacement(*parts.env, parts.group_options, parts.elastic_wait + std::chrono::seconds(30), parts.elastic_wait);
  if (!admission) throw FitEndedBeforeAdmission();
  progress::test_kill_point(progress::KillPoint::HandOff, admission->step + 1);
  // A replacement on rank 0's machine reads rank 0's copy, which rank 0 removes.
  ::trainloop::detail::ResumeSpec next = admission_hand_off(actions, ::trainloop::distributed::detail::session_group().group,
                                                            admission->hand_off.empty(), admission->hand_off,
                                                            /*removes_it=*/false, /*sharded=*/false, /*loop_state_only=*/false,
                                                            parts);
  pending.keep(next, admission->step, *parts.commits);
  return next;
}

/// The loop's fit, again from the committed state with the survivors after each lost rank, and
/// with the replacements admitted at a step boundary (see the file comment). Errors that are not
/// a lost rank's consequence end the fit as they would without elastic training.
inline History train_elastic(const ::trainloop::detail::FitActions& actions, const ::trainloop::detail::ResumeSpec& start,
                             const ElasticFitParts& parts) {
  PendingHandOff pending;
  // The commits' hook points at `pending`: it goes before `pending` does, however the fit ends.
  struct HookReset {
    StepCommitter* commits;
    ~HookReset() { commits->after_next_commit(nullptr); }
  } hook_reset{parts.commits};
  ::trainloop::detail::ResumeSpec from = awaiting_admission() ? join_running_fit(actions, parts, pending) : start;
  for (;;) {
    try {
      try {
        History history = actions.train(from);
        const ProcessGroup& group = ::trainloop::distributed::detail::session_group().group;
        if (group.valid() && group.rank() == 0) close_admissions(*group.job_store());  // replacements still waiting end
        return history;
      } catch (const ReplacementsJoin& join) {
        // A replacement lost while the grown group hands it the state (another machine's) is lost
        // as any rank: the members still hold the step they were resuming (below).
        from = admit_replacements(actions, join, parts, pending);
      }
    } catch (const std::exception& error) {
      const ProcessGroup& group = ::trainloop::distributed::detail::session_group().group;
      if (!detail::may_be_a_lost_rank(error) || !group.valid() || group.world_size() == 1) throw;
      std::optional<::trainloop::detail::ResumeSpec> next = recover_from_lost_rank(actions, start, parts, pending);
      if (!next) throw;
      from = *next;
    }
  }
}

}  // namespace trainloop::distributed::elastic
