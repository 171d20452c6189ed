// op_profile.hpp: where a training step's time goes, op by op, through libtorch's RecordFunction
// observers (the hooks torch.profiler itself is built on; public in libtorch 1.13 and 2.x).
//
// Hand-written because the benchmarks need two things torch.profiler's C++ side does not give in
// a few lines on both libtorch versions: the *self* time of each op (its time minus the ops it
// calls, so convolution_backward is not also counted inside ConvolutionBackward0), and the time
// of a region spent *outside* every op — the loop's own work plus the dispatcher's, which is the
// number the "trainloop's own share" goal is about.
//
//   OpProfile profile;            // observers on from here...
//   run_some_steps();
//   profile.stop();               // ...to here (or the end of the scope)
//   profile.print(std::cout, 20);
//
// OpProfile(OpProfile::Key::op_and_caller) keys each row by the op *and* the op that called it
// ("aten::copy_ < aten::to"; "(top)" when called from outside every op): where the many small copies
// and fills of a step come from.
//
// One OpProfile at a time per process. Cost: two clock reads and a mutex per op; on the
// Fashion-MNIST CNN (~60 ops per step) that is below the noise of the step time, but the figures
// are for finding where time goes, not for quoting throughput: take throughput without it.
#pragma once

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <vector>

namespace bench {

/// One op's totals over a profiled region.
struct OpTotals {
  std::string name;
  int64_t calls = 0;
  double self_seconds = 0.0;   ///< time inside the op, minus the ops it called
  double total_seconds = 0.0;  ///< time inside the op, including the ops it called
};

/// Collects per-op call counts and self/total time between its construction and stop().
class OpProfile {
 public:
  /// How rows are keyed: by op name, or by op name and the name of the op that called it.
  enum class Key { op, op_and_caller };

  explicit OpProfile(Key key = Key::op) : started_(Clock::now()) {
    {
      const std::lock_guard<std::mutex> lock(state().mutex);
      state().totals.clear();
      state().by_caller = key == Key::op_and_caller;
    }
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end).needsInputs(false));
  }
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;
  ~OpProfile() { stop(); }

  /// Ends the region: no op after this is counted.
  void stop() {
    if (handle_ == at::INVALID_CALLBACK_HANDLE) return;
    at::removeCallback(handle_);
    handle_ = at::INVALID_CALLBACK_HANDLE;
    wall_seconds_ = seconds_since(started_);
  }

  /// Wall time of the region (up to stop()).
  double wall_seconds() const { return wall_seconds_; }

  /// Every op seen, the largest self time first.
  std::vector<OpTotals> ops() const {
    std::vector<OpTotals> out;
    {
      const std::lock_guard<std::mutex> lock(state().mutex);
      for (const auto& [name, t] : state().totals) out.push_back(t);
    }
    std::sort(out.begin(), out.end(),
              [](const OpTotals& a, const OpTotals& b) { return a.self_seconds > b.self_seconds; });
    return out;
  }

  /// Time of the region inside some op, counted once however deeply ops nest. On one thread the
  /// rest of the wall time is spent outside libtorch's ops: the caller's loop, allocation between
  /// ops, Python or trainloop bookkeeping.
  double seconds_in_ops() const {
    double sum = 0.0;
    for (const auto& t : ops()) sum += t.self_seconds;
    return sum;
  }

  /// Prints the `rows` ops with the largest self time, then the time outside every op.
  void print(std::ostream& out, size_t rows, int64_t steps) const {
    const auto all = ops();
    const double wall = wall_seconds_;
    const double per_step = steps > 0 ? 1e3 / static_cast<double>(steps) : 1e3;
    char line[256];
    bool by_caller = false;
    {
      const std::lock_guard<std::mutex> lock(state().mutex);
      by_caller = state().by_caller;
    }
    const int width = by_caller ? 72 : 40;
    std::snprintf(line, sizeof line, "%-*s %8s %12s %8s %12s\n", width, by_caller ? "op < caller" : "op", "calls", "self ms/step", "self %",
                  "total ms/step");
    out << line;
    for (size_t i = 0; i < std::min(rows, all.size()); ++i) {
      const auto& t = all[i];
      std::snprintf(line, sizeof line, "%-*.*s %8lld %12.3f %7.1f%% %12.3f\n", width, width, t.name.c_str(),
                    static_cast<long long>(t.calls), t.self_seconds * per_step,
                    wall > 0 ? 100.0 * t.self_seconds / wall : 0.0, t.total_seconds * per_step);
      out << line;
    }
    const double in_ops = seconds_in_ops();
    std::snprintf(line, sizeof line, "%-*s %8s %12.3f %7.1f%%\n", width, "(all ops)", "", in_ops * per_step,
                  wall > 0 ? 100.0 * in_ops / wall : 0.0);
    out << line;
    std::snprintf(line, sizeof line, "%-*s %8s %12.3f %7.1f%%\n", width, "(outside every op)", "",
                  (wall - in_ops) * per_step, wall > 0 ? 100.0 * (wall - in_ops) / wall : 0.0);
    out << line;
  }

 private:
  using Clock = std::chrono::steady_clock;

  static double seconds_since(Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  }

  /// What one running op carries from its start to its end.
  struct Frame : at::ObserverContext {
    Clock::time_point start = Clock::now();
    double children_seconds = 0.0;
    Frame* parent = nullptr;
    const char* name = "";  ///< the op's name (RecordFunction names are static strings)
  };

  struct State {
    std::mutex mutex;
    bool by_caller = false;
    std::map<std::string, OpTotals> totals;
  };
  static State& state() {
    static State s;
    return s;
  }
  /// The innermost running op of this thread (ops nest per thread; autograd's CPU backward runs
  /// on the caller's thread, DataParallel replicas each on their own).
  static Frame*& innermost() {
    thread_local Frame* frame = nullptr;
    return frame;
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    auto frame = std::make_unique<Frame>();
    frame->name = fn.name();
    frame->parent = innermost();
    innermost() = frame.get();
    return frame;
  }

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* context) {
    auto* frame = static_cast<Frame*>(context);
    const double total = seconds_since(frame->start);
    innermost() = frame->parent;
    if (frame->parent != nullptr) frame->parent->children_seconds += total;
    const std::lock_guard<std::mutex> lock(state().mutex);
    std::string key = fn.name();
    if (state().by_caller) key += std::string(" < ") + (frame->parent != nullptr ? frame->parent->name : "(top)");
    OpTotals& t = state().totals[key];
    if (t.name.empty()) t.name = key;
    t.calls += 1;
    t.self_seconds += std::max(0.0, total - frame->children_seconds);
    t.total_seconds += total;
  }

  Clock::time_point started_;
  double wall_seconds_ = 0.0;
  at::CallbackHandle handle_ = at::INVALID_CALLBACK_HANDLE;
};

}  // namespace bench
