#pragma once
/// @file
/// @brief What each rank's stall watchdog publishes to the job's store once per period: where the
/// rank is (progress/progress_beacon.hpp), how long it has made no progress, which collective it
/// is blocked in, and its last collectives' fingerprints — as a few lines of text ("name value").
/// One record is ~1 KB; with 16 calls it fits one TCPStore message.

#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <cstdint>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::distributed {

/// One rank's published state.
struct RankRecord {
  int rank = 0;                    ///< whose record
  long pid = 0;                    ///< its process id
  std::string host;                ///< its host name
  std::uint64_t tick = 0;          ///< its watchdog's publications so far: a frozen process stops counting
  double stale_seconds = 0.0;      ///< time since its progress last changed (0 while blocked in a collective)
  double limit_seconds = 0.0;      ///< its stall limit now
  std::int64_t epoch = 0;          ///< its epoch
  std::int64_t step = 0;           ///< its global step
  std::int64_t batch = 0;          ///< its micro-batch within the epoch
  std::int64_t batches = 0;        ///< micro-batches in the epoch
  progress::Phase phase = progress::Phase::Idle;  ///< its phase
  std::string detail;              ///< the phase's detail
  std::uint64_t issued = 0;        ///< collectives it issued
  std::uint64_t waiting_seq = 0;   ///< the collective it is blocked in (0: none)
  std::string waiting_what;        ///< what that wait is for
  double waiting_seconds = 0.0;    ///< for how long
  std::vector<progress::CollectiveCall> calls;  ///< its last collectives, oldest first
  std::int64_t steps_timed = 0;    ///< steps it completed in this process (the straggler check's count)
  double part_seconds[progress::kStepParts] = {};  ///< its time per step part so far, collective waits left out
  bool missing = false;            ///< not published: the rank never published a record (not in the text)

  /// Calls published per record.
  static constexpr std::size_t kCalls = 16;

  /// "epoch 2, step 17 (batch 5 of 40), phase forward (SleepyModel)".
  std::string position() const {
    if (missing) return "no record published (it froze or ended before its watchdog's first period)";
    std::string text = "epoch " + std::to_string(epoch) + ", step " + std::to_string(step);
    if (batches > 0) text += " (batch " + std::to_string(batch) + " of " + std::to_string(batches) + ")";
    text += ", phase " + std::string(progress::phase_name(phase));
    if (!detail.empty()) text += " (" + detail + ")";
    return text;
  }
  /// The call numbered `seq`, if published.
  const progress::CollectiveCall* call(std::uint64_t seq) const {
    for (const auto& c : calls) {
      if (c.seq == seq) return &c;
    }
    return nullptr;
  }
  /// "blocked for 61.8 s in gradient all-reduce, collective #103 all_reduce(sum) Float[4112] ... in step 17".
  std::string blocked_in() const {
    std::ostringstream out;
    out.precision(1);
    out << std::fixed << "blocked for " << waiting_seconds << " s in " << waiting_what;
    if (const auto* c = call(waiting_seq)) out << ", collective " << c->describe();
    else out << ", collective #" << waiting_seq;
    return out.str();
  }

  /// The record as text.
  std::string to_text() const {
    std::ostringstream out;
    out.precision(3);
    out << std::fixed << "trainloop-watch 1\nrank " << rank << "\npid " << pid << "\nhost " << one_line(host)
        << "\ntick " << tick << "\nstale " << stale_seconds << "\nlimit " << limit_seconds << "\nepoch " << epoch
        << "\nstep " << step << "\nbatch " << batch << "\nbatches " << batches << "\nphase "
        << static_cast<int>(phase) << "\ndetail " << one_line(detail) << "\nissued " << issued << "\nwaiting_seq "
        << waiting_seq << "\nwaiting_what " << one_line(waiting_what) << "\nwaiting_seconds " << waiting_seconds
        << "\nsteps_timed " << steps_timed << "\nparts";
    out.precision(6);
    for (double seconds : part_seconds) out << ' ' << seconds;
    out << "\n";
    for (const auto& c : calls) {
      out << "call " << c.seq << ' ' << static_cast<int>(c.kind) << ' ' << (c.dtype.empty() ? "-" : c.dtype) << ' '
          << c.numel << ' ' << c.root << ' ' << c.step << ' ' << one_line(c.label) << "\n";
    }
    return out.str();
  }

  /// Parses to_text()'s output; nothing for another text (a record of another version).
  static std::optional<RankRecord> parse(const std::string& text) {
    std::istringstream in(text);
    std::string line;
    if (!std::getline(in, line) || line != "trainloop-watch 1") return std::nullopt;
    RankRecord r;
    while (std::getline(in, line)) {
      const auto space = line.find(' ');
      const std::string name = line.substr(0, space);
      const std::string value = space == std::string::npos ? "" : line.substr(space + 1);
      const char* v = value.c_str();
      if (name == "rank") r.rank = std::atoi(v);
      else if (name == "pid") r.pid = std::atol(v);
      else if (name == "host") r.host = value;
      else if (name == "tick") r.tick = std::strtoull(v, nullptr, 10);
      else if (name == "stale") r.stale_seconds = std::atof(v);
      else if (name == "limit") r.limit_seconds = std::atof(v);
      else if (name == "epoch") r.epoch = std::atoll(v);
      else if (name == "step") r.step = std::atoll(v);
      else if (name == "batch") r.batch = std::atoll(v);
      else if (name == "batches") r.batches = std::atoll(v);
      else if (name == "phase") r.phase = static_cast<progress::Phase>(std::atoi(v));
      else if (name == "detail") r.detail = value;
      else if (name == "issued") r.issued = std::strtoull(v, nullptr, 10);
      else if (name == "waiting_seq") r.waiting_seq = std::strtoull(v, nullptr, 10);
      else if (name == "waiting_what") r.waiting_what = value;
      else if (name == "waiting_seconds") r.waiting_seconds = std::atof(v);
      else if (name == "steps_timed") r.steps_timed = std::atoll(v);
      else if (name == "parts") {
        std::istringstream fields(value);
        for (double& seconds : r.part_seconds) fields >> seconds;
      }
      else if (name == "call") {
        std::istringstream fields(value);
        progress::CollectiveCall c;
        int kind = 0;
        fields >> c.seq >> kind >> c.dtype >> c.numel >> c.root >> c.step;
        if (!fields) continue;
        c.kind = static_cast<progress::CollectiveKind>(kind);
        if (c.dtype == "-") c.dtype.clear();
        std::getline(fields >> std::ws, c.label);
        r.calls.push_back(std::move(c));
      }
    }
    return r;
  }

 private:
  static std::string one_line(std::string text) {
    for (char& c : text) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    return text;
  }
};

/// The first collective number both records hold with different calls, or 0 when they agree.
inline std::uint64_t first_mismatch(const RankRecord& a, const RankRecord& b) {
  for (const auto& call : a.calls) {
    if (const auto* other = b.call(call.seq); other != nullptr && !call.matches(*other)) return call.seq;
  }
  return 0;
}

}  // namespace trainloop::distributed
