#pragma once
/// @file
/// @brief The words of the stall watchdog's reports: a stalled rank (with its threads' stacks), a
/// rank named from outside (frozen, or silent), two ranks that called different collectives —
/// built from the ranks' published records (rank_record.hpp). docs/modes-and-launching.md shows
/// each, verbatim from a run.

#include <trainloop/distributed/watch/rank_record.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/thread_stack.hpp>

#include <chrono>
#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::distributed {

/// What happens after a report, in the report's last line.
inline std::string stall_action_words(StallAction action) {
  return action == StallAction::Fail
             ? "the job ends as for a failed rank (TRAINLOOP_STALL_ACTION=report reports and keeps waiting; "
               "TRAINLOOP_STALL_LIMIT sets the limit, \"off\" turns the watchdog off)"
             : "the job keeps waiting (StallAction::Report); the collective timeout ends it if nothing moves";
}

/// This process's training thread's stack (and the loader workers' while it loads a batch), one
/// frame per line, each thread headed by `rank`'s name for it.
inline std::string thread_stacks_text(int rank, progress::Phase phase) {
  std::ostringstream out;
  for (const auto& thread : progress::progress_beacon().threads().list()) {
    const bool training = thread.role == "training thread";
    if (!training && phase != progress::Phase::LoadingBatch) continue;
    out << "\n  rank " << rank << "'s " << thread.role << " (thread " << thread.tid << "), innermost call first:";
    const auto frames = progress::capture_thread_stack(thread.tid, std::chrono::seconds(2));
    if (!frames) {
      out << "\n    (no answer within 2 s: the thread is in uninterruptible sleep, e.g. a read from a file "
             "system that does not answer, or blocks the signal)";
      continue;
    }
    const auto lines = progress::symbolize_stack(*frames);
    for (std::size_t i = 0; i < lines.size() && i < 40; ++i) out << "\n    #" << i << " " << lines[i];
  }
  return out.str();
}

/// A rank (`own`) stalled while the ranks in `waiting` wait for it (none: every rank is stuck);
/// `records` are every rank's, `stacks` its threads' (thread_stacks_text).
inline std::string stall_report(const RankRecord& own, const std::vector<RankRecord>& records,
                                const std::vector<const RankRecord*>& waiting, const std::string& stacks,
                                StallAction action) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << "trainloop: rank " << own.rank << " stalled: no progress for " << own.stale_seconds
      << " s (stall limit " << own.limit_seconds << " s) in " << own.position();
  if (!waiting.empty()) {
    out << ", while " << (waiting.size() == 1 ? "rank " : "ranks ");
    for (std::size_t i = 0; i < waiting.size(); ++i) out << (i ? ", " : "") << waiting[i]->rank;
    out << (waiting.size() == 1 ? " waits" : " wait") << " for it";
  } else {
    out << "; every rank is stuck";
  }
  out << "\n  rank " << own.rank << " (pid " << own.pid << " on " << own.host << "): last collective "
      << (own.calls.empty() ? std::string("none") : own.calls.back().describe());
  for (const auto& r : records) {
    if (r.rank == own.rank) continue;
    out << "\n  rank " << r.rank << " (pid " << r.pid << " on " << r.host << "): ";
    if (r.waiting_seq != 0) out << r.blocked_in() << "; " << r.position();
    else out << r.position() << ", no progress for " << r.stale_seconds << " s";
  }
  out << stacks << "\n  " << stall_action_words(action);
  return out.str();
}

/// Rank `silent_rank` holds up the collective `own` has waited in for twice the limit (it never
/// called it, or its process does not answer) and did not report itself; its watchdog has not
/// published for `silent_seconds`.
inline std::string unresponsive_report(const RankRecord& own, const RankRecord& silent_rank, double silent_seconds,
                                       StallAction action) {
  std::ostringstream out;
  out.precision(1);
  out << std::fixed << "trainloop: rank " << silent_rank.rank << " stalled: rank " << own.rank << " has been "
      << own.blocked_in() << " and rank " << silent_rank.rank
      << (silent_rank.issued < own.waiting_seq ? " never called it; " : " called it, but its process does not take part; ");
  if (silent_seconds >= own.limit_seconds) {
    out << "its watchdog has not published for " << silent_seconds
        << " s (its process is stopped or frozen, or its host is down), so it cannot report itself";
  } else {
    out << "it did not report itself (its stall limit is " << silent_rank.limit_seconds << " s)";
  }
  out << "\n  rank " << silent_rank.rank;
  if (!silent_rank.missing) out << " (pid " << silent_rank.pid << " on " << silent_rank.host << ")";
  out << ": " << silent_rank.position() << ", last collective "
      << (silent_rank.calls.empty() ? std::string("none") : silent_rank.calls.back().describe()) << "\n  "
      << stall_action_words(action);
  return out.str();
}

/// Ranks `a` and `b` called different collectives as their number `seq`.
inline std::string desync_report(const RankRecord& a, const RankRecord& b, std::uint64_t seq) {
  const RankRecord& low = a.rank < b.rank ? a : b;
  const RankRecord& high = a.rank < b.rank ? b : a;
  std::ostringstream out;
  out << "trainloop: ranks " << low.rank << " and " << high.rank << " called different collectives as their collective #"
      << seq << " (every rank must call the same collectives in the same order: a collective on some ranks "
      << "only, a skipped step, a tensor of another shape or dtype?)";
  for (const RankRecord* r : {&low, &high}) {
    const progress::CollectiveCall* call = r->call(seq);
    out << "\n  rank " << r->rank << ": "
        << (call != nullptr ? call->describe() : "#" + std::to_string(seq) + " (older than its last calls)")
        << "; now in " << r->position();
    if (r->waiting_seq != 0) out << ", " << r->blocked_in();
  }
  // The calls before #seq agreed: the last common one shows where the ranks were in step.
  if (seq > 1) {
    if (const auto* before = low.call(seq - 1)) out << "\n  the ranks agreed up to " << before->describe();
  }
  return out.str();
}

}  // namespace trainloop::distributed
