#pragma once
/// @file
/// @brief trainloop::distributed::ProgressClock: a rank's own view for its stall watchdog — the
/// progress beacon (progress/progress_beacon.hpp) read into the record it publishes
/// (rank_record.hpp), with how long the rank has made no progress by its own measure, and
/// whether that stall has been reported.
///
/// The clock of no progress restarts whenever the beacon's progress moves, and while the rank
/// waits in a collective: waiting is not a stall of this rank. Outside fit, evaluate and predict
/// (phase idle), and while rank 0 works first, nothing is judged stale.

#include <trainloop/distributed/watch/rank_record.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <string>

namespace trainloop::distributed {

/// This rank's record and its clock of no progress (see the file comment). Not thread-safe: the
/// watchdog serialises its calls.
class ProgressClock {
 public:
  /// @param rank this rank
  /// @param options its stall limits
  /// @param timeout the collective timeout, which bounds the limits
  ProgressClock(int rank, const StallWatchOptions& options, std::chrono::milliseconds timeout)
      : rank_(rank), options_(options), timeout_(timeout) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    host_ = host;
  }

  /// This rank's record now (its stale_seconds: how long it has made no progress by its own
  /// measure). Counts a tick: each call is one publication.
  RankRecord record() {
    progress::ProgressBeacon& beacon = progress::progress_beacon();
    const progress::ProgressSnapshot s = beacon.snapshot();
    const progress::CollectiveLog::Waiting waiting = beacon.collectives().waiting();
    const auto now = Clock::now();
    // Waiting in a collective is not a stall of this rank: the clock of no progress restarts.
    if (s.progress != last_progress_ || !progress_seen_ || waiting.seq != 0) {
      last_progress_ = s.progress;
      progress_seen_ = true;
      progress_since_ = now;
      if (waiting.seq == 0) reported_ = false;
    }
    RankRecord r;
    r.rank = rank_;
    r.pid = static_cast<long>(::getpid());
    r.host = host_;
    r.tick = ++tick_;
    const bool judged = waiting.seq == 0 && s.phase != progress::Phase::Idle && s.phase != progress::Phase::RankZeroFirst;
    r.stale_seconds = judged ? std::chrono::duration<double>(now - progress_since_).count() : 0.0;
    r.limit_seconds = options_.limit_for(progress::is_checkpoint_phase(s.phase), s.steps_timed, s.slowest_step_seconds, timeout_);
    r.epoch = s.epoch;
    r.step = s.global_step;
    r.batch = s.batch;
    r.batches = s.batches;
    r.phase = s.phase;
    r.detail = s.detail;
    r.issued = beacon.collectives().issued();
    r.waiting_seq = waiting.seq;
    r.waiting_what = waiting.what;
    r.waiting_seconds = waiting.seconds;
    r.calls = beacon.collectives().recent(RankRecord::kCalls);
    r.steps_timed = s.steps_timed;
    for (int part = 0; part < progress::kStepParts; ++part) r.part_seconds[part] = s.part_seconds[part];
    return r;
  }

  /// True once this stall was reported: one report per stall, until the rank makes progress
  /// again outside a collective.
  bool reported() const { return reported_; }
  /// Records that this stall was reported.
  void mark_reported() { reported_ = true; }

 private:
  using Clock = std::chrono::steady_clock;

  int rank_;
  StallWatchOptions options_;
  std::chrono::milliseconds timeout_;
  std::string host_;
  std::uint64_t tick_ = 0;
  std::uint64_t last_progress_ = 0;
  bool progress_seen_ = false;
  Clock::time_point progress_since_{};
  bool reported_ = false;
};

}  // namespace trainloop::distributed
