#pragma once
/// @file
/// @brief trainloop::distributed::StallWatchdog: one thread per rank that names a rank which hangs
/// (rather than dies) within the stall limit, and ranks that call different collectives at the
/// collective where they part — instead of every rank waiting out the collective timeout.
///
/// Each period (a tenth of the limit, 0.2 to 1 s) a rank's watchdog:
/// - publishes its record (rank_record.hpp) to the job's store: one `set`;
/// - compares its last collectives with the next rank's record: one `get`. Every rank checks its
///   successor, so all ranks agree when each pair does: a desync is found within a period of the
///   collective where the ranks part (a skipped collective, another kind, dtype or size);
/// - when its own progress has stopped for the limit (outside a collective wait, inside fit,
///   evaluate or predict), or it has waited in a collective for twice the limit, reads every
///   record and applies stall_judgement.hpp: the stalled rank reports with its stacks; with
///   StallAction::Fail it ends as a failed rank does, and the waiting ranks, seeing its verdict in
///   the store, end too (so srun and mpirun, which may wait for every task, end at once).
/// Nothing runs per step: the loop only sets the beacon's atomics. The store is met through a
/// WatchBoard (watch_board.hpp), a rank's own record made by its ProgressClock
/// (progress_clock.hpp), the reports worded in stall_report.hpp, and a desync that a backend
/// reports by ending the process named through a TerminateHook (terminate_hook.hpp). Outside fit,
/// evaluate and predict (phase idle) nothing is judged a stall: a rank working alone before a
/// barrier is a program's choice. Desyncs are judged everywhere.

#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/failure_report.hpp>
#include <trainloop/distributed/launch/spawned_rank.hpp>
#include <trainloop/distributed/watch/progress_clock.hpp>
#include <trainloop/distributed/watch/rank_record.hpp>
#include <trainloop/distributed/watch/stall_judgement.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/distributed/watch/stall_report.hpp>
#include <trainloop/distributed/watch/straggler_watch.hpp>
#include <trainloop/progress/straggler_events.hpp>
#include <trainloop/distributed/watch/terminate_hook.hpp>
#include <trainloop/distributed/watch/watch_board.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/thread_stack.hpp>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// The watchdog of one rank (see the file comment). Made by start_stall_watchdog().
class StallWatchdog {
 public:
  /// Connects its own store client and starts the thread.
  /// @param group_options the options the rank's process group was made with (address, prefix)
  /// @param env who this rank is (for the launcher's failure files)
  /// @param options when a rank is stalled, and what happens then
  StallWatchdog(const ProcessGroupOptions& group_options, RankEnv env, StallWatchOptions options)
      : env_(std::move(env)), options_(options), rank_(group_options.rank), world_size_(group_options.world_size),
        own_(group_options.rank, options, group_options.timeout), board_(group_options) {
    progress::install_stack_capture();
    progress::progress_beacon().collectives().set_failure_explainer(
        [this](std::uint64_t seq) { return explain_failed_collective(seq); });
    thread_ = std::thread([this] { run(); });
    // A backend that finds a mismatch in its own thread (Gloo: "Received data size doesn't match")
    // ends the process through std::terminate: name the desync there too.
    terminate_hook_.emplace([this](const std::string& backend_error) { on_backend_terminate(backend_error); },
                            thread_.get_id());
  }
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;
  /// Stops and joins the thread.
  ~StallWatchdog() {
    terminate_hook_.reset();
    progress::progress_beacon().collectives().set_failure_explainer({});
    {
      std::lock_guard<std::mutex> lock(stop_mutex_);
      stopping_ = true;
    }
    stop_changed_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  using Clock = std::chrono::steady_clock;

  /// An exception escaped a thread other than the watchdog's (TerminateHook): if the ranks called
  /// different collectives as this rank's last one, that is the report.
  void on_backend_terminate(const std::string& backend_error) {
    const std::uint64_t seq = progress::progress_beacon().collectives().issued();
    if (auto desync = progress::progress_beacon().collectives().explain_failure(seq)) {
      act("trainloop: " + *desync + "\n  the backend ended rank " + std::to_string(rank_) +
              " with: " + backend_error.substr(0, backend_error.find('\n')),
          "trainloop::DesyncError", /*consequence=*/false);
    }
  }

  /// The period: a tenth of the limit, between 0.2 and 1 s; 0.2 s while stragglers are watched (a
  /// straggler is named within a few readings: straggler_watch.hpp).
  std::chrono::milliseconds period() const {
    const auto most = std::chrono::milliseconds(options_.straggler.enabled ? 200 : 1000);
    return std::clamp(options_.limit / 10, std::chrono::milliseconds(200), most);
  }

  void run() {
    int store_failures = 0;
    std::unique_lock<std::mutex> lock(stop_mutex_);
    bool first = true;  // the first record at once: a rank that freezes early is still on the board
    while (std::exchange(first, false) || !stop_changed_.wait_for(lock, period(), [this] { return stopping_; })) {
      lock.unlock();
      try {
        tick();
        store_failures = 0;
      } catch (const std::exception&) {
        // The store goes when rank 0 ends; a job that lost it has lost its collectives too.
        if (++store_failures == 3) {
          lock.lock();
          return;
        }
      }
      lock.lock();
    }
  }

  /// The main process: every rank's own time per step compared, a slow rank named
  /// (straggler_watch.hpp). Each reading reads every record: every max(1, world size / 64) periods.
  void watch_stragglers(const RankRecord& own) {
    if (!options_.straggler.enabled || ++straggler_ticks_ % std::max(1, world_size_ / 64) != 0) return;
    std::vector<RankRecord> records{own};
    for (int r = 1; r < world_size_; ++r) {
      if (auto record = board_.read(r)) records.push_back(std::move(*record));
    }
    for (const std::string& line : straggler_.update(records)) std::fprintf(stderr, "%s\n", line.c_str());
    for (StragglerRecord& record : straggler_.take_records()) progress::straggler_events().post(std::move(record));
  }

  /// Every rank's record — at most once per period x max(2, world size / 64): while ranks wait or
  /// stall each reads all records, which must not swamp the store of a large job. Nothing between.
  std::optional<std::vector<RankRecord>> read_all(const RankRecord& own) {
    const auto now = Clock::now();
    if (now - last_read_all_ < period() * std::max(2, world_size_ / 64)) return std::nullopt;
    last_read_all_ = now;
    std::vector<RankRecord> records;
    for (int r = 0; r < world_size_; ++r) {
      if (r == rank_) {
        records.push_back(own);
      } else if (auto record = board_.read(r)) {
        records.push_back(std::move(*record));
        auto& seen = ticks_seen_[r];
        if (seen.first != records.back().tick) seen = {records.back().tick, now};
      } else {
        ticks_seen_.try_emplace(r, 0, now);  // none yet: silent since now
      }
    }
    return records;
  }

  void tick() {
    RankRecord own;
    {
      std::lock_guard<std::mutex> lock(tick_mutex_);
      own = own_.record();
    }
    const double stale = own.stale_seconds;
    board_.publish(own);
    if (world_size_ < 2) return;
    if (rank_ == 0) watch_stragglers(own);
    // Desync: this rank's calls against its successor's.
    if (auto next = board_.read((rank_ + 1) % world_size_)) {
      if (const std::uint64_t seq = first_mismatch(own, *next); seq != 0) return desync(own, *next, seq);
    }
    const double limit = own.limit_seconds;
    // A rank blocked in a collective (Gloo), or stuck behind one on the device (NCCL's host waits in
    // a synchronisation, not in the collective), follows another rank's verdict — before judging
    // itself.
    if ((own.waiting_seq != 0 && own.waiting_seconds >= std::min(limit, 2.0 * period_seconds())) ||
        stale >= 2.0 * period_seconds()) {
      if (auto verdict = board_.verdict()) return follow_verdict(*verdict);
    }
    if (stale >= limit && !own_.reported()) {
      if (auto records = read_all(own)) judge_own_stall(own, *records);
      return;
    }
    if (own.waiting_seq != 0 && own.waiting_seconds >= limit) {
      // Keep the others' ticks in view from here on, to tell a frozen rank from a busy one.
      const auto records = read_all(own);
      if (records && own.waiting_seconds >= 2.0 * limit + 5.0 && !own_.reported()) judge_from_outside(own, *records);
    }
  }

  double period_seconds() const { return static_cast<double>(period().count()) / 1000.0; }

  /// This rank made no progress for its limit: report when it is the rank that stalled.
  void judge_own_stall(const RankRecord& own, const std::vector<RankRecord>& records) {
    const auto waiting = ranks_waiting_for(own, records, world_size_);
    if (!waiting) return;
    own_.mark_reported();
    act(stall_report(own, records, *waiting, thread_stacks_text(rank_, own.phase), options_.action),
        "trainloop::StallError", /*consequence=*/false);
  }

  /// Reports `report`, and with StallAction::Fail ends this process as a failed rank.
  void act(const std::string& report, const char* type, bool consequence) {
    if (options_.action == StallAction::Report) {
      std::fprintf(stderr, "%s\n", report.c_str());
      std::fflush(stderr);
      return;
    }
    if (!consequence) {
      const std::string headline = report.substr(0, report.find('\n'));
      try {
        board_.leave_verdict(WatchVerdict{type, headline});
      } catch (...) {
      }
    }
    report_rank_failure(env_, FailureDescription{type, report, report, consequence});
    if (env_.source != RankEnvSource::Trainloop) {
      std::fprintf(stderr, "%s\n", report.c_str());  // torchrun, srun, mpirun: the rank's output carries it
    }
    std::fflush(nullptr);
    ::_exit(1);  // the training thread is stuck: nothing else can end this process
  }

  /// Another rank reported: with StallAction::Fail this waiting rank ends too, a moment later (so
  /// that launchers see the reporting rank end first and name it).
  void follow_verdict(const WatchVerdict& verdict) {
    if (options_.action == StallAction::Report) return;
    const auto now = Clock::now();
    if (!verdict_seen_) verdict_seen_ = now;
    if (now - *verdict_seen_ < std::chrono::seconds(2)) return;
    const char* type = verdict.type == "trainloop::DesyncError" ? "trainloop::DesyncError" : "trainloop::StallError";
    act("trainloop: rank " + std::to_string(rank_) + " ends because another rank reported: " + verdict.headline, type,
        /*consequence=*/true);
  }

  /// Waited twice the limit with no verdict: name a rank that stopped publishing or is behind.
  void judge_from_outside(const RankRecord& own, const std::vector<RankRecord>& published) {
    const auto now = Clock::now();
    const auto found = unresponsive_rank(own, published, world_size_, [&](int rank) {
      const auto seen = ticks_seen_.find(rank);
      return seen == ticks_seen_.end() ? 0.0 : std::chrono::duration<double>(now - seen->second.second).count();
    });
    if (!found) return;
    own_.mark_reported();  // once (StallAction::Report goes on waiting)
    act(unresponsive_report(own, found->record, found->silent_seconds, options_.action), "trainloop::StallError",
        /*consequence=*/false);
  }

  /// Two ranks' collective #seq differ.
  void desync(const RankRecord& own, const RankRecord& other, std::uint64_t seq) {
    if (desync_reported_) return;
    desync_reported_ = true;
    act(desync_report(own, other, seq), "trainloop::DesyncError", /*consequence=*/false);
  }

  /// For ProcessGroup::wait: a collective failed; if the ranks called different ones as #seq, the
  /// words naming both calls. Publishes this rank's record at once, then reads the others' for up
  /// to two periods (they publish within one).
  std::optional<std::string> explain_failed_collective(std::uint64_t seq) {
    if (world_size_ < 2 || seq == 0) return std::nullopt;
    const auto mine = progress::progress_beacon().collectives().call(seq);
    if (!mine) return std::nullopt;
    RankRecord own;
    {
      std::lock_guard<std::mutex> lock(tick_mutex_);
      own = own_.record();
    }
    board_.publish(own);
    if (auto other = board_.find_other_call(rank_, world_size_, *mine, period())) {
      return desync_report(own, *other, seq).substr(std::string("trainloop: ").size());
    }
    return std::nullopt;
  }

  RankEnv env_;
  StallWatchOptions options_;
  int rank_;
  int world_size_;
  // The watchdog thread's own view (the explainer takes tick_mutex_ to share own_.record()).
  ProgressClock own_;
  WatchBoard board_;
  std::mutex tick_mutex_;
  bool desync_reported_ = false;
  std::optional<Clock::time_point> verdict_seen_;
  Clock::time_point last_read_all_{};
  std::map<int, std::pair<std::uint64_t, Clock::time_point>> ticks_seen_;
  StragglerWatch straggler_{options_.straggler};  // the main process's: a slow rank named
  std::uint64_t straggler_ticks_ = 0;
  std::mutex stop_mutex_;
  std::condition_variable stop_changed_;
  bool stopping_ = false;
  std::thread thread_;
  std::optional<TerminateHook> terminate_hook_;  // made once thread_ runs, removed first
};

}  // namespace trainloop::distributed
