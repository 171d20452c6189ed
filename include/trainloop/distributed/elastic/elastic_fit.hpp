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
/// Replacements (admit_into_fit.hpp): at the step boundary the ranks agreed on, every member
/// leaves the fit (ReplacementsJoin), the group grows by the replacements admitted, and every rank
/// — the replacements too, which enter here before their fit trains — resumes from the step
/// committed last with the grown world size, handed over from memory.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/comm/text_collectives.hpp>
#include <trainloop/distributed/elastic/admit_into_fit.hpp>
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
