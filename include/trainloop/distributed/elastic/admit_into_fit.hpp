#pragma once
/// @file
/// @brief Elastic training's admissions (elastic_fit.hpp's fit calls them): at the step boundary the
/// ranks agreed on, the members grow the group by the replacements rank 0 admits and hand them the
/// committed step from memory (admit_replacements); a replacement joins the running fit before its
/// own trains (join_running_fit); what each resumes from (admission_hand_off).

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
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace trainloop::distributed::elastic {

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

}  // namespace trainloop::distributed::elastic
