#pragma once
/// @file
/// @brief A test hook that kills this process (SIGKILL, no cleanup: as the OOM killer or a lost
/// machine would) at a chosen step and phase, so elastic recovery can be proved at every point
/// where a rank can die. Off unless TRAINLOOP_TEST_KILL_AT is set; then one relaxed load per point.
///
/// `TRAINLOOP_TEST_KILL_AT=<rank>:<step>:<phase>` — the launcher's rank number (TRAINLOOP_RANK,
/// RANK), the step in flight (optimizer steps completed + 1, counted over the whole run), and one
/// of: `forward` (its first micro-batch's forward), `backward` (right after the step's first
/// gradient bucket was handed to the all-reduce: its peers are inside that collective),
/// `optimizer` (the step's gradients reduced and agreed, before the optimizer steps), `checkpoint`
/// (inside a checkpoint write at the end of that step), `evaluation` (the validation after the
/// epoch whose last step is that one), `background-write` (the writer thread of the checkpoint
/// written behind training at the end of that step, once its file is written and before it tells
/// rank 0 or, on rank 0, commits: checkpoint/background_write.hpp), `share-copy` (elastic training of sharded
/// state: inside the exchange of the step's copies with the neighbours, at the start of that step:
/// distributed/elastic/share_copies.hpp). Only the process whose rank matches dies; several
/// comma-separated plans kill several ranks (`1:3:forward,2:3:forward`). With
/// `TRAINLOOP_TEST_KILL_MARK=<file>` it dies only if the file does not exist yet, and writes the
/// time of the kill into it first (seconds since the Unix epoch): a restarted rank reaching the
/// same point lives, and a benchmark knows when the death happened.

#include <trainloop/progress/progress_beacon.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <unistd.h>

namespace trainloop::progress {

/// Where a test may kill a rank (see the file comment).
enum class KillPoint : std::uint8_t { Forward, Backward, Optimizer, Checkpoint, Evaluation, BackgroundWrite, ShareCopy };

namespace detail {

struct KillPlan {
  bool armed = false;
  int rank = -1;
  std::int64_t step = 0;
  KillPoint point = KillPoint::Forward;
  std::string mark;  // TRAINLOOP_TEST_KILL_MARK
};

inline KillPlan parse_kill_plan() {
  KillPlan plan;
  const char* text = std::getenv("TRAINLOOP_TEST_KILL_AT");
  const char* own = std::getenv("TRAINLOOP_RANK");
  if (own == nullptr) own = std::getenv("RANK");
  if (text == nullptr || own == nullptr) return plan;
  // This rank's plan among comma-separated ones (the first that names it; else the first).
  std::string spec(text);
  for (std::size_t start = 0; start <= spec.size();) {
    const std::size_t end = std::min(spec.find(',', start), spec.size());
    const std::string one = spec.substr(start, end - start);
    if (one.substr(0, one.find(':')) == own) {
      spec = one;
      break;
    }
    start = end + 1;
  }
  if (const auto comma = spec.find(','); comma != std::string::npos) spec = spec.substr(0, comma);
  const auto first = spec.find(':'), second = spec.find(':', first == std::string::npos ? first : first + 1);
  if (first == std::string::npos || second == std::string::npos) return plan;
  plan.rank = std::atoi(spec.substr(0, first).c_str());
  plan.step = std::atoll(spec.substr(first + 1, second - first - 1).c_str());
  const std::string_view point = std::string_view(spec).substr(second + 1);
  if (point == "forward") plan.point = KillPoint::Forward;
  else if (point == "backward") plan.point = KillPoint::Backward;
  else if (point == "optimizer") plan.point = KillPoint::Optimizer;
  else if (point == "checkpoint") plan.point = KillPoint::Checkpoint;
  else if (point == "evaluation") plan.point = KillPoint::Evaluation;
  else if (point == "background-write") plan.point = KillPoint::BackgroundWrite;
  else if (point == "share-copy") plan.point = KillPoint::ShareCopy;
  else return plan;
  plan.armed = plan.rank == std::atoi(own);
  if (const char* mark = std::getenv("TRAINLOOP_TEST_KILL_MARK")) plan.mark = mark;
  return plan;
}

inline const KillPlan& kill_plan() {
  static const KillPlan plan = parse_kill_plan();
  return plan;
}

}  // namespace detail

/// Kills this process when the test plan names this rank, `step` and `point` (a thread that is
/// not the training thread: the step it works for).
inline void test_kill_point(KillPoint point, std::int64_t step) {
  const detail::KillPlan& plan = detail::kill_plan();
  if (!plan.armed || plan.point != point || step != plan.step) return;
  if (!plan.mark.empty()) {
    if (std::filesystem::exists(plan.mark)) return;  // killed once already: a restarted rank lives
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::ofstream(plan.mark) << std::fixed << now << '\n';
  }
  ::kill(::getpid(), SIGKILL);
}

/// Kills this process when the test plan names this rank, the step in flight and `point`.
inline void test_kill_point(KillPoint point) {
  const detail::KillPlan& plan = detail::kill_plan();
  if (!plan.armed || plan.point != point) return;
  // A checkpoint written at the end of step S, and the validation after it, see S completed.
  const bool after_step = point == KillPoint::Checkpoint || point == KillPoint::Evaluation;
  test_kill_point(point, progress_beacon().global_step() + (after_step ? 0 : 1));
}

}  // namespace trainloop::progress
