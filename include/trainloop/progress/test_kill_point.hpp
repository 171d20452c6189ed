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
/// state: its copies of that step taken, at the step's start, before it seals them or tells its
/// keeper where they are: distributed/elastic/share_copies.hpp), `join` (a replacement admitted to join at that step,
/// before it joins the grown group: distributed/elastic/replacement_join.hpp), `hand-off` (the same
/// replacement once in the grown group, before the state is handed to it: admit_into_fit.hpp). Only the
/// process whose rank matches dies; several
/// comma-separated plans kill several ranks (`1:3:forward,2:3:forward`), or one rank's place
/// again (`2:3:forward,2:8:forward`: its replacement, joined after step 3, dies at step 8). A plan
/// ending in `@<g>` fires only while the job's group is in generation g (elastic training: 0 for the
/// first group, +1 per regroup or admission): `1:3:forward@1` kills rank 1 in step 3 only once the
/// survivors of a first loss redo it, not when it first passes there. With
/// `TRAINLOOP_TEST_KILL_MARK=<file>` it dies only if the file does not exist yet, and writes the
/// time of the kill into it first (seconds since the Unix epoch): a restarted rank reaching the
/// same point lives, and a benchmark knows when the death happened. With
/// `TRAINLOOP_TEST_KILL_LAUNCHER=1` it kills its parent first (the machine's launcher, SIGKILL): the
/// rank's whole machine is gone, nothing is left there to start a replacement.

#include <trainloop/detail/environment.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>
#include <unistd.h>

namespace trainloop::progress {

/// The generation of the job's process group: 0 for the first, +1 per regroup or admission of
/// elastic training (distributed/elastic/regroup.hpp keeps it here, where the kill plans read it).
/// Atomic: kill points on other threads (a checkpoint's writer) read it.
inline std::atomic<int>& group_generation() {
  static std::atomic<int> value{0};
  return value;
}

/// Where a test may kill a rank (see the file comment).
enum class KillPoint : std::uint8_t { Forward, Backward, Optimizer, Checkpoint, Evaluation, BackgroundWrite, ShareCopy, Join, HandOff };

namespace detail {

/// One place a plan kills this rank.
struct KillAt {
  std::int64_t step = 0;
  KillPoint point = KillPoint::Forward;
  int generation = -1;  // the group's generation it waits for; -1: any
};

struct KillPlan {
  std::vector<KillAt> at;  // this rank's
  std::string mark;        // TRAINLOOP_TEST_KILL_MARK
  bool with_launcher = false;  // TRAINLOOP_TEST_KILL_LAUNCHER: the parent too
  bool names(KillPoint point) const {
    return std::any_of(at.begin(), at.end(), [point](const KillAt& one) { return one.point == point; });
  }
  bool names(KillPoint point, std::int64_t step) const {
    return std::any_of(at.begin(), at.end(), [&](const KillAt& one) {
      return one.step == step && one.point == point && (one.generation < 0 || one.generation == group_generation().load());
    });
  }
};

inline std::optional<KillPoint> parse_kill_point(std::string_view point) {
  if (point == "forward") return KillPoint::Forward;
  if (point == "backward") return KillPoint::Backward;
  if (point == "optimizer") return KillPoint::Optimizer;
  if (point == "checkpoint") return KillPoint::Checkpoint;
  if (point == "evaluation") return KillPoint::Evaluation;
  if (point == "background-write") return KillPoint::BackgroundWrite;
  if (point == "share-copy") return KillPoint::ShareCopy;
  if (point == "join") return KillPoint::Join;
  if (point == "hand-off") return KillPoint::HandOff;
  return std::nullopt;
}

/// One plan `<rank>:<step>:<point>[@<generation>]`, checked whole: a test whose plan has a typo
/// must fail naming it, not run without the kill it meant.
inline std::pair<long, KillAt> parse_one_kill_plan(const std::string& one) {
  const std::string what = ::trainloop::detail::concat("TRAINLOOP_TEST_KILL_AT's plan '", one, "'");
  const auto first = one.find(':'), second = first == std::string::npos ? first : one.find(':', first + 1);
  TRAINLOOP_CHECK(second != std::string::npos, what,
                  " has fewer than two ':'; expected <rank>:<step>:<point>[@<generation>]");
  const std::size_t at_generation = one.find('@', second);
  const std::string_view text(one);
  const std::string_view point_name =
      text.substr(second + 1, at_generation == std::string::npos ? std::string::npos : at_generation - second - 1);
  const std::optional<KillPoint> point = parse_kill_point(point_name);
  TRAINLOOP_CHECK(point.has_value(), what, " names the point '", point_name,
                  "'; expected forward, backward, optimizer, checkpoint, evaluation, background-write, share-copy, join or "
                  "hand-off");
  KillAt at;
  at.step = ::trainloop::detail::parse_integer(text.substr(first + 1, second - first - 1), what + "'s step", 1,
                                               std::numeric_limits<long>::max());
  at.point = *point;
  if (at_generation != std::string::npos) {
    at.generation = static_cast<int>(::trainloop::detail::parse_integer(text.substr(at_generation + 1),
                                                                        what + "'s generation", 0, 1 << 20));
  }
  return {::trainloop::detail::parse_integer(text.substr(0, first), what + "'s rank", 0, 1 << 20), at};
}

inline KillPlan parse_kill_plan() {
  KillPlan plan;
  const char* text = std::getenv("TRAINLOOP_TEST_KILL_AT");
  const char* own = std::getenv("TRAINLOOP_RANK");
  if (own == nullptr) own = std::getenv("RANK");
  if (text == nullptr || own == nullptr) return plan;
  const long own_rank = ::trainloop::detail::parse_integer(own, "TRAINLOOP_RANK", 0, 1 << 20);
  // Every comma-separated plan that names this rank (a replacement of the rank reaches the later ones).
  const std::string spec(text);
  for (std::size_t start = 0; start <= spec.size();) {
    const std::size_t end = std::min(spec.find(',', start), spec.size());
    const std::string one = spec.substr(start, end - start);
    start = end + 1;
    if (one.empty()) continue;
    const auto [rank, at] = parse_one_kill_plan(one);
    if (rank == own_rank) plan.at.push_back(at);
  }
  if (const char* mark = std::getenv("TRAINLOOP_TEST_KILL_MARK")) plan.mark = mark;
  if (const char* launcher = std::getenv("TRAINLOOP_TEST_KILL_LAUNCHER")) plan.with_launcher = std::string_view(launcher) == "1";
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
  if (!plan.names(point, step)) return;
  if (!plan.mark.empty()) {
    if (std::filesystem::exists(plan.mark)) return;  // killed once already: a restarted rank lives
    const double now = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::ofstream(plan.mark) << std::fixed << now << '\n';
  }
  if (plan.with_launcher) ::kill(::getppid(), SIGKILL);
  ::kill(::getpid(), SIGKILL);
}

/// Kills this process when the test plan names this rank, the step in flight and `point`.
inline void test_kill_point(KillPoint point) {
  const detail::KillPlan& plan = detail::kill_plan();
  if (!plan.names(point)) return;
  // A checkpoint written at the end of step S, and the validation after it, see S completed.
  const bool after_step = point == KillPoint::Checkpoint || point == KillPoint::Evaluation;
  test_kill_point(point, progress_beacon().global_step() + (after_step ? 0 : 1));
}

}  // namespace trainloop::progress
