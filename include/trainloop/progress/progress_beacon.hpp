#pragma once
/// @file
/// @brief trainloop::progress::ProgressBeacon: where this process is in training — epoch, step,
/// batch, phase (loading a batch, forward, backward, optimizer step, evaluation, checkpoint, a
/// callback by name) — kept in atomics the loop sets as it goes, for the stall watchdog
/// (distributed/watch/) to read and publish once a second.
///
/// Cost, and why it is this shape: a phase change is a few relaxed atomic stores and, with a
/// detail text, one uncontended mutex and a copy of at most kDetailBytes (tens of nanoseconds;
/// a step sets about ten phases). Nothing is done per operator or per tensor, and nothing here
/// talks to other processes: publishing is the watchdog thread's work. Measured in
/// benchmarks/run_stall_watch_cost.sh (docs/modes-and-launching.md, "When a rank hangs").

#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/thread_registry.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>
#include <utility>

namespace trainloop::progress {

/// What a process is doing. Stored in one byte; phase_name() words it.
enum class Phase : std::uint8_t {
  Idle,             ///< outside fit, evaluate and predict
  Setup,            ///< joining the group, syncing the model, resuming a checkpoint
  LoadingBatch,     ///< waiting for the next training batch from the loader
  Forward,          ///< the model's forward and the criterion
  Backward,         ///< backward (gradient collectives run meanwhile)
  OptimizerStep,    ///< reducing the last gradients, clipping, the optimizer's step
  Evaluation,       ///< evaluate() / validation / predict()
  CheckpointWrite,  ///< writing a checkpoint (its own, longer limit)
  CheckpointRead,   ///< reading a checkpoint (its own, longer limit)
  Callback,         ///< a callback; the detail names it and its hook
  MainOnlyCallback, ///< a callback that runs on the main process only (files, plots) while the others wait
  RankZeroFirst,    ///< rank0_first(): rank 0 works while the others wait (never a stall)
};

/// The phase in words, as reports print it.
inline const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::Idle: return "idle";
    case Phase::Setup: return "setup";
    case Phase::LoadingBatch: return "loading a batch";
    case Phase::Forward: return "forward";
    case Phase::Backward: return "backward";
    case Phase::OptimizerStep: return "optimizer step";
    case Phase::Evaluation: return "evaluation";
    case Phase::CheckpointWrite: return "checkpoint write";
    case Phase::CheckpointRead: return "checkpoint read";
    case Phase::Callback: return "callback";
    case Phase::MainOnlyCallback: return "main-process callback";
    case Phase::RankZeroFirst: return "rank0_first";
  }
  return "unknown";
}

/// A phase of file work, slow by nature, judged with the checkpoint limit (StallWatchOptions): a
/// checkpoint's write or read, a callback that writes files or plots on the main process alone.
inline bool is_checkpoint_phase(Phase phase) {
  return phase == Phase::CheckpointWrite || phase == Phase::CheckpointRead || phase == Phase::MainOnlyCallback;
}

/// The parts of a training step whose time ranks compare to name a straggler (the stall
/// watchdog's straggler check): waiting for the input, forward, backward, the optimizer step.
inline constexpr int kStepParts = 4;

/// The step part `phase` belongs to, -1 for none.
inline int step_part_of(Phase phase) {
  switch (phase) {
    case Phase::LoadingBatch: return 0;
    case Phase::Forward: return 1;
    case Phase::Backward: return 2;
    case Phase::OptimizerStep: return 3;
    default: return -1;
  }
}

/// A step part in words, as the straggler line prints it.
inline const char* step_part_name(int part) {
  static const char* const names[kStepParts] = {"input", "forward", "backward", "optimizer"};
  return part >= 0 && part < kStepParts ? names[part] : "unknown";
}

/// What the beacon holds at one moment (ProgressBeacon::snapshot()).
struct ProgressSnapshot {
  std::uint64_t progress = 0;     ///< changes whenever the process does something new
  std::int64_t epoch = 0;         ///< the epoch being trained (1-based), 0 before fit
  std::int64_t global_step = 0;   ///< optimizer steps completed
  std::int64_t batch = 0;         ///< micro-batches of the epoch started
  std::int64_t batches = 0;       ///< micro-batches in the epoch
  Phase phase = Phase::Idle;      ///< what it is doing
  std::string detail;             ///< e.g. the callback's name and hook, "batch 3 of 40"
  std::int64_t steps_timed = 0;   ///< steps whose duration was measured in this process
  double slowest_step_seconds = 0.0;  ///< the longest of them (after the first, which compiles and warms up)
  /// Seconds this process spent in each step part so far (step_part_name), its waits in
  /// collectives left out: its own work and its wait for input.
  double part_seconds[kStepParts] = {};
};

/// The process's progress. One per process (progress_beacon()); every setter is safe from any thread.
class ProgressBeacon {
 public:
  /// Longest detail text kept (longer ones are cut).
  static constexpr std::size_t kDetailBytes = 96;

  /// Sets the phase and its detail ("" for none), or "<detail>::<member>" when `member` is given
  /// (a callback's hook: composed here, so callers allocate nothing); counts as progress.
  void set_phase(Phase phase, const char* detail = "", const char* member = nullptr) {
    {
      std::lock_guard<std::mutex> lock(detail_mutex_);
      std::snprintf(detail_, kDetailBytes, member != nullptr ? "%s::%s" : "%s", detail != nullptr ? detail : "",
                    member != nullptr ? member : "");
      const Phase left = static_cast<Phase>(phase_.exchange(static_cast<std::uint8_t>(phase), std::memory_order_relaxed));
      // The time of the part just left, less the collective waits in it: one clock read per phase
      // change (a few per step), for the straggler check.
      const std::int64_t now = now_ns();
      const std::int64_t since = std::exchange(phase_since_ns_, now);
      const std::int64_t waited = collectives_.take_waited_ns();
      // A callback's time belongs to the part it interrupted (a slow on_train_batch is input).
      const bool callback = left == Phase::Callback || left == Phase::MainOnlyCallback;
      if (const int part = callback ? enclosing_part_ : step_part_of(left); part >= 0 && since != 0) {
        part_ns_[part].fetch_add(std::max<std::int64_t>(0, now - since - waited), std::memory_order_relaxed);
      }
      if (step_part_of(phase) >= 0 || (phase != Phase::Callback && phase != Phase::MainOnlyCallback)) {
        enclosing_part_ = step_part_of(phase);
      }
    }
    advance();
  }
  /// The current phase.
  Phase phase() const { return static_cast<Phase>(phase_.load(std::memory_order_relaxed)); }
  /// The current detail text.
  std::string detail() const {
    std::lock_guard<std::mutex> lock(detail_mutex_);
    return detail_;
  }
  /// The current phase, and its detail copied into `detail` (kDetailBytes, no allocation).
  Phase phase_and_detail(char (&detail)[kDetailBytes]) const {
    std::lock_guard<std::mutex> lock(detail_mutex_);
    std::memcpy(detail, detail_, kDetailBytes);
    return static_cast<Phase>(phase_.load(std::memory_order_relaxed));
  }

  /// Marks progress without changing the phase (a batch of evaluation, bytes of a checkpoint).
  void advance() { progress_.fetch_add(1, std::memory_order_relaxed); }

  /// Where training stands: set at each micro-batch.
  void set_position(std::int64_t epoch, std::int64_t batch, std::int64_t batches) {
    epoch_.store(epoch, std::memory_order_relaxed);
    batch_.store(batch, std::memory_order_relaxed);
    batches_.store(batches, std::memory_order_relaxed);
    advance();
  }

  /// An optimizer step completed (global step `global_step`): times it against the previous one.
  /// The first step timed in a process is not counted in the slowest (it compiles, allocates and
  /// warms caches; StallWatchOptions::grace_steps covers it).
  void step_completed(std::int64_t global_step) {
    const std::int64_t now = now_ns();
    const std::int64_t previous = last_step_ns_.exchange(now, std::memory_order_relaxed);
    const std::int64_t timed = steps_timed_.fetch_add(1, std::memory_order_relaxed) + 1;
    if (previous != 0 && timed > 1) {
      const std::int64_t took = now - previous;
      std::int64_t slowest = slowest_step_ns_.load(std::memory_order_relaxed);
      while (took > slowest && !slowest_step_ns_.compare_exchange_weak(slowest, took, std::memory_order_relaxed)) {
      }
    }
    global_step_.store(global_step, std::memory_order_relaxed);
    advance();
  }
  /// The step clock restarts (a new fit: the time between fits is no step).
  void restart_step_clock() { last_step_ns_.store(0, std::memory_order_relaxed); }
  /// Sets the global step without timing it (a resumed checkpoint).
  void set_global_step(std::int64_t global_step) { global_step_.store(global_step, std::memory_order_relaxed); }
  /// The global step the beacon holds.
  std::int64_t global_step() const { return global_step_.load(std::memory_order_relaxed); }

  /// Everything at once, for the watchdog (the fields are read one by one: a snapshot taken
  /// during a change may mix two moments, which a once-a-second observer does not mind).
  ProgressSnapshot snapshot() const {
    ProgressSnapshot s;
    s.progress = progress_.load(std::memory_order_relaxed);
    s.epoch = epoch_.load(std::memory_order_relaxed);
    s.global_step = global_step_.load(std::memory_order_relaxed);
    s.batch = batch_.load(std::memory_order_relaxed);
    s.batches = batches_.load(std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(detail_mutex_);
      s.phase = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
      s.detail = detail_;
    }
    s.steps_timed = steps_timed_.load(std::memory_order_relaxed);
    s.slowest_step_seconds = static_cast<double>(slowest_step_ns_.load(std::memory_order_relaxed)) * 1e-9;
    for (int part = 0; part < kStepParts; ++part) {
      s.part_seconds[part] = static_cast<double>(part_ns_[part].load(std::memory_order_relaxed)) * 1e-9;
    }
    return s;
  }

  /// The collectives this process issued (collective_log.hpp).
  CollectiveLog& collectives() { return collectives_; }
  /// The threads whose stacks a stall report shows (thread_registry.hpp).
  ThreadRegistry& threads() { return threads_; }

  /// Nanoseconds on the steady clock.
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

 private:
  std::atomic<std::uint64_t> progress_{0};
  std::atomic<std::int64_t> epoch_{0};
  std::atomic<std::int64_t> global_step_{0};
  std::atomic<std::int64_t> batch_{0};
  std::atomic<std::int64_t> batches_{0};
  std::atomic<std::uint8_t> phase_{0};
  std::atomic<std::int64_t> last_step_ns_{0};
  std::atomic<std::int64_t> slowest_step_ns_{0};
  std::atomic<std::int64_t> steps_timed_{0};
  std::array<std::atomic<std::int64_t>, kStepParts> part_ns_{};  // time per step part, waits left out
  std::int64_t phase_since_ns_ = 0;                               // when the phase began (under detail_mutex_)
  int enclosing_part_ = -1;                                       // the step part a callback interrupts (same)
  mutable std::mutex detail_mutex_;
  char detail_[kDetailBytes] = {};
  CollectiveLog collectives_;
  ThreadRegistry threads_;
};

/// This process's beacon. Never destroyed: threads that outlive main's statics (the stall
/// watchdog, loader workers, libtorch's) may still read or set it at exit.
inline ProgressBeacon& progress_beacon() {
  static ProgressBeacon* const beacon = new ProgressBeacon;
  return *beacon;
}

/// Sets a phase for a scope and puts the previous phase and detail back when it ends (a callback
/// inside the optimizer step, an evaluation inside on_epoch_end). Allocates nothing: it runs
/// around every callback of every batch.
class PhaseScope {
 public:
  /// Enters `phase` with `detail` (or "<detail>::<member>").
  explicit PhaseScope(Phase phase, const char* detail = "", const char* member = nullptr)
      : previous_(progress_beacon().phase_and_detail(previous_detail_)) {
    progress_beacon().set_phase(phase, detail, member);
  }
  /// Enters `phase` with `detail`.
  PhaseScope(Phase phase, const std::string& detail) : PhaseScope(phase, detail.c_str()) {}
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;
  ~PhaseScope() { progress_beacon().set_phase(previous_, previous_detail_); }

 private:
  char previous_detail_[ProgressBeacon::kDetailBytes];
  Phase previous_;
};

}  // namespace trainloop::progress
