#pragma once
/// @file
/// @brief trainloop::progress::CollectiveLog: the collectives this process issued, numbered in
/// issue order, each with its fingerprint (kind, dtype, element count, root, the step it was
/// issued in): the last kRing of them, and which one a thread is blocked in.
///
/// Every rank issues the same collectives in the same order (process_group.hpp), so collective
/// number n must have the same fingerprint on every rank: the stall watchdog compares them across ranks
/// to name a desync at the collective where it happened. The record costs one mutex and a copy of
/// ~80 bytes per collective (a gradient bucket, a metric): no communication. A thread-local label
/// (CollectiveLabel) says what the collective is for ("gradient bucket 2 of 5").

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::progress {

/// What a collective does; part of its fingerprint.
enum class CollectiveKind : std::uint8_t {
  AllReduceSum, AllReduceMax, Broadcast, AllGather, Gather, ReduceScatter, Barrier, PassToLeft, SendBytes
};

/// The kind in words.
inline const char* collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::AllReduceSum: return "all_reduce(sum)";
    case CollectiveKind::AllReduceMax: return "all_reduce(max)";
    case CollectiveKind::Broadcast: return "broadcast";
    case CollectiveKind::AllGather: return "all_gather";
    case CollectiveKind::Gather: return "gather";
    case CollectiveKind::ReduceScatter: return "reduce_scatter";
    case CollectiveKind::Barrier: return "barrier";
    case CollectiveKind::PassToLeft: return "pass_to_left";
    case CollectiveKind::SendBytes: return "send_bytes";
  }
  return "collective";
}

/// One collective as issued: what every rank's collective of the same number must match.
struct CollectiveCall {
  std::uint64_t seq = 0;         ///< 1-based number in this process's issue order
  CollectiveKind kind = CollectiveKind::Barrier;  ///< what it does
  std::string dtype;             ///< e.g. "Float"; "" for a barrier
  std::int64_t numel = 0;        ///< elements this rank sends
  std::int32_t root = -1;        ///< the root rank of a broadcast or gather, else -1
  std::int64_t step = 0;         ///< the global step when it was issued
  std::string label;             ///< what it is for, e.g. "gradient bucket 2 of 5" ("" unknown)

  /// True when two ranks' calls of the same number are the same collective.
  bool matches(const CollectiveCall& other) const {
    return kind == other.kind && dtype == other.dtype && numel == other.numel && root == other.root &&
           step == other.step;
  }
  /// "#12 all_reduce(sum) Float[4112] (gradient bucket 1 of 2) in step 7".
  std::string describe() const {
    std::string text = "#" + std::to_string(seq) + " " + collective_kind_name(kind);
    if (kind != CollectiveKind::Barrier) text += " " + dtype + "[" + std::to_string(numel) + "]";
    if (root >= 0) text += " from root " + std::to_string(root);
    if (!label.empty()) text += " (" + label + ")";
    text += " in step " + std::to_string(step);
    return text;
  }
};

/// Names the collectives a thread issues while it lives ("gradient bucket 2 of 5"): the
/// reducer's comm thread and the sharded units label theirs.
class CollectiveLabel {
 public:
  /// Labels as `what` (kept by pointer: a string literal or one that outlives the scope).
  explicit CollectiveLabel(const char* what, int index = -1, int count = -1) : previous_(current()) {
    if (index >= 0) {
      std::snprintf(text_, sizeof text_, "%s %d of %d", what, index + 1, count);
    } else {
      std::snprintf(text_, sizeof text_, "%s", what);
    }
    current() = text_;
  }
  CollectiveLabel(const CollectiveLabel&) = delete;
  CollectiveLabel& operator=(const CollectiveLabel&) = delete;
  ~CollectiveLabel() { current() = previous_; }
  /// This thread's label, or nullptr.
  static const char*& current() {
    static thread_local const char* label = nullptr;
    return label;
  }

 private:
  const char* previous_;
  char text_[48] = {};
};

/// The collectives of one process (see the file comment).
class CollectiveLog {
 public:
  /// Calls kept for comparison across ranks and for reports.
  static constexpr std::size_t kRing = 64;

  /// Records a collective as it is issued; returns its number. `work` identifies its handle, so
  /// that a later wait on it can say which collective it waits for (nullptr for none).
  std::uint64_t issue(CollectiveKind kind, std::string dtype, std::int64_t numel, std::int32_t root, std::int64_t step,
                      const void* work = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    Entry& entry = ring_[issued_ % kRing];
    entry.call.seq = ++issued_;
    entry.call.kind = kind;
    entry.call.dtype = std::move(dtype);
    entry.call.numel = numel;
    entry.call.root = root;
    entry.call.step = step;
    const char* label = CollectiveLabel::current();
    entry.call.label = label != nullptr ? label : "";
    entry.work = work;
    return entry.call.seq;
  }
  /// Ties the handle of collective `seq` to it after the backend returned one.
  void set_work(std::uint64_t seq, const void* work) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (Entry* entry = find(seq)) entry->work = work;
  }
  /// The number of the collective whose handle is `work`, or 0 when it is no longer in the ring.
  std::uint64_t seq_of(const void* work) const {
    std::lock_guard<std::mutex> lock(mutex_);
    // Newest first: a finished collective's handle may have been freed and its address reused.
    for (std::uint64_t seq = issued_; seq > 0 && issued_ - seq < kRing; --seq) {
      const Entry& entry = ring_[(seq - 1) % kRing];
      if (entry.work == work && entry.call.seq == seq) return seq;
    }
    return 0;
  }

  /// Numbers collectives from 1 again: the survivors of a lost rank regroup (elastic training),
  /// and the new group's ranks compare their calls from its first one.
  void restart() {
    std::lock_guard<std::mutex> lock(mutex_);
    ring_ = {};
    issued_ = 0;
    waiting_seq_ = 0;
  }

  /// Collectives issued so far.
  std::uint64_t issued() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return issued_;
  }
  /// The last `count` calls (oldest first).
  std::vector<CollectiveCall> recent(std::size_t count = kRing) const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<CollectiveCall> calls;
    const std::uint64_t first = issued_ > count ? issued_ - count : 0;
    for (std::uint64_t seq = first + 1; seq <= issued_; ++seq) {
      const Entry& entry = ring_[(seq - 1) % kRing];
      if (entry.call.seq == seq) calls.push_back(entry.call);
    }
    return calls;
  }
  /// Call `seq`, while it is in the ring.
  std::optional<CollectiveCall> call(std::uint64_t seq) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const Entry* entry = const_cast<CollectiveLog*>(this)->find(seq);
    if (entry == nullptr) return std::nullopt;
    return entry->call;
  }

  /// A thread starts blocking on collective `seq` ("gradient all-reduce" is `what`).
  void begin_wait(std::uint64_t seq, const char* what) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_seq_ = seq;
    waiting_what_ = what;
    waiting_since_ = std::chrono::steady_clock::now();
  }
  /// The wait on `seq` ended. (Waiting is not a stall; the watchdog restarts its clock of no
  /// progress while a thread waits.)
  void end_wait(std::uint64_t seq) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waiting_seq_ == seq) {
      waiting_seq_ = 0;
      waited_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - waiting_since_)
                        .count();
    }
  }
  /// Nanoseconds spent blocked in collectives since the last call (the beacon subtracts them from
  /// the phase they fell in: a rank's own work, not the wait for slower ones, is what is compared).
  std::int64_t take_waited_ns() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(waited_ns_, 0);
  }
  /// What a blocked thread waits for: its collective's number (0: none), what, and since when.
  struct Waiting {
    std::uint64_t seq = 0;           ///< 0 when no thread is blocked in a collective
    std::string what;                ///< the caller's words ("gradient all-reduce")
    double seconds = 0.0;            ///< how long it has waited
  };
  /// The wait in progress, if any.
  Waiting waiting() const {
    std::lock_guard<std::mutex> lock(mutex_);
    Waiting w;
    if (waiting_seq_ == 0) return w;
    w.seq = waiting_seq_;
    w.what = waiting_what_;
    w.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting_since_).count();
    return w;
  }

  /// Who explains a failed collective (the stall watchdog: it compares the ranks' calls). Returns
  /// the explanation, or nothing when the ranks' calls agree (or it cannot tell).
  using FailureExplainer = std::function<std::optional<std::string>(std::uint64_t seq)>;
  /// Installs `explainer` (empty to remove it).
  void set_failure_explainer(FailureExplainer explainer) {
    std::lock_guard<std::mutex> lock(explainer_mutex_);
    explainer_ = std::move(explainer);
  }
  /// Asks the explainer about collective `seq` (nothing when none is installed).
  std::optional<std::string> explain_failure(std::uint64_t seq) const {
    FailureExplainer explainer;
    {
      std::lock_guard<std::mutex> lock(explainer_mutex_);
      explainer = explainer_;
    }
    if (!explainer) return std::nullopt;
    try {
      return explainer(seq);
    } catch (...) {
      return std::nullopt;  // explaining must never hide the failure itself
    }
  }

 private:
  struct Entry {
    CollectiveCall call;
    const void* work = nullptr;
  };
  Entry* find(std::uint64_t seq) {
    if (seq == 0 || seq > issued_ || issued_ - seq >= kRing) return nullptr;
    Entry& entry = ring_[(seq - 1) % kRing];
    return entry.call.seq == seq ? &entry : nullptr;
  }

  mutable std::mutex mutex_;
  std::array<Entry, kRing> ring_{};
  std::uint64_t issued_ = 0;
  std::uint64_t waiting_seq_ = 0;
  const char* waiting_what_ = "";
  std::chrono::steady_clock::time_point waiting_since_{};
  std::int64_t waited_ns_ = 0;
  mutable std::mutex explainer_mutex_;
  FailureExplainer explainer_;
};

}  // namespace trainloop::progress
