#pragma once
/// @file
/// @brief The rank that slows everyone, named. In DDP every rank waits for the slowest in each
/// gradient all-reduce, so step times are equal everywhere and nothing in them points at it; what
/// differs is each rank's own time — waiting for its input, its forward, its backward (until its
/// last gradient is ready), its optimizer step — with the waits in collectives left out
/// (progress/progress_beacon.hpp measures it per phase change, a clock read each). Every rank's
/// watchdog publishes those sums with its record (rank_record.hpp: no collective, nothing per
/// step); the main process's watchdog compares them at each reading: per step since the last
/// reading, each rank's total against the median of the others'. A rank whose excess passes
/// `least_excess` and `least_fraction` of the others' total for `readings` readings in a row is
/// named, once a minute at most while it lasts, with the part where it loses most:
///
///     trainloop: straggler: rank 2 (pid 4711, host n3) +148 ms per step in backward (step 17)
///
/// and a line when it no longer trails; each also as a StragglerRecord, which the rank's training
/// thread adds to the History and hands to Callback::on_straggler. Defaults from measurements: see docs/modes-and-launching.md.

#include <trainloop/distributed/watch/rank_record.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/history.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// What one reading found.
struct StragglerReading {
  int rank = -1;              ///< the rank that trails most (-1: none past the thresholds)
  double excess_ms = 0.0;     ///< by how much per step
  int part = -1;              ///< where it loses most (progress::step_part_name)
};

/// Compares every rank's own time per step (see the file comment). Fed the records read at each
/// reading; says what to log.
class StragglerWatch {
 public:
  /// A watch with these thresholds, nobody named yet.
  explicit StragglerWatch(StragglerOptions options) : options_(options) {}

  /// One reading of every rank's record. Returns the lines to log (none, a new straggler, the same
  /// one again after repeat_after, or one that no longer trails).
  std::vector<std::string> update(const std::vector<RankRecord>& records,
                                  std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
    std::vector<std::string> lines;
    if (!options_.enabled) return lines;
    const std::optional<StragglerReading> reading = read(records);
    if (!reading) return lines;  // no rank completed a step since the last reading
    if (reading->rank >= 0 && reading->rank == candidate_) {
      ++in_a_row_;
    } else {
      candidate_ = reading->rank;
      in_a_row_ = reading->rank >= 0 ? 1 : 0;
    }
    if (named_ >= 0 && reading->rank != named_) {
      if (++clear_in_a_row_ >= options_.readings) {
        lines.push_back(line_head(named_) + " no longer trails (it did for " +
                        seconds_text(std::chrono::duration<double>(now - named_since_).count()) + ")");
        StragglerRecord ended = named_record_;
        ended.step = newest_step(records);
        ended.ended = true;
        records_.push_back(std::move(ended));
        named_ = -1;
      }
    } else {
      clear_in_a_row_ = 0;
    }
    if (candidate_ >= 0 && in_a_row_ >= options_.readings &&
        (named_ != candidate_ || now - last_line_ >= options_.repeat_after)) {
      if (named_ != candidate_) named_since_ = now;
      named_ = candidate_;
      last_line_ = now;
      const std::int64_t step = newest_step(records);
      char excess[96];
      std::snprintf(excess, sizeof excess, " +%.0f ms per step in %s (step %lld)", reading->excess_ms,
                    progress::step_part_name(reading->part), static_cast<long long>(step));
      lines.push_back(line_head(named_) + excess);
      const auto who = who_.find(named_);
      named_record_ = StragglerRecord{step, named_, who != who_.end() ? who->second.first : 0,
                                      who != who_.end() ? who->second.second : std::string(),
                                      progress::step_part_name(reading->part), reading->excess_ms, false};
      records_.push_back(named_record_);
    }
    return lines;
  }

  /// What update() logged since the last call, as History records (for the training thread:
  /// progress/straggler_events.hpp).
  std::vector<StragglerRecord> take_records() { return std::exchange(records_, {}); }

  /// The rank named now (-1: none).
  int named() const { return named_; }

 private:
  struct Sums {
    std::int64_t steps = 0;
    double parts[progress::kStepParts] = {};
  };

  /// Per rank, the time per step in each part since the last reading; the rank that trails most.
  std::optional<StragglerReading> read(const std::vector<RankRecord>& records) {
    std::map<int, std::vector<double>> per_step;  // rank -> time per step in each part (ms)
    std::size_t published = 0;
    for (const RankRecord& record : records) {
      if (record.missing) continue;
      ++published;
      who_[record.rank] = {record.pid, record.host};
      Sums now;
      now.steps = record.steps_timed;
      std::copy(std::begin(record.part_seconds), std::end(record.part_seconds), std::begin(now.parts));
      const auto last = last_.find(record.rank);
      if (last != last_.end() && now.steps > last->second.steps) {
        std::vector<double> parts(progress::kStepParts);
        const double steps = static_cast<double>(now.steps - last->second.steps);
        for (int p = 0; p < progress::kStepParts; ++p) parts[p] = 1000.0 * (now.parts[p] - last->second.parts[p]) / steps;
        per_step[record.rank] = parts;
      }
      if (last == last_.end() || now.steps != last->second.steps) last_[record.rank] = now;
    }
    // A reading counts when every rank has news: a slow rank's own watchdog publishes late too (a
    // stopped process publishes nothing), and a reading without it must not clear its streak.
    if (per_step.size() < 2 || per_step.size() < published) return std::nullopt;
    StragglerReading found;
    for (const auto& [rank, parts] : per_step) {
      std::vector<std::vector<double>> others;
      for (const auto& [other, other_parts] : per_step) {
        if (other != rank) others.push_back(other_parts);
      }
      const double own_total = total(parts);
      std::vector<double> other_totals;
      for (const auto& o : others) other_totals.push_back(total(o));
      const double typical = median(other_totals);
      const double excess = own_total - typical;
      if (excess < static_cast<double>(options_.least_excess.count()) || excess < options_.least_fraction * typical) continue;
      if (excess <= found.excess_ms) continue;
      found.rank = rank;
      found.excess_ms = excess;
      double worst = -1e300;
      for (int p = 0; p < progress::kStepParts; ++p) {
        std::vector<double> theirs;
        for (const auto& o : others) theirs.push_back(o[p]);
        if (parts[p] - median(theirs) > worst) {
          worst = parts[p] - median(theirs);
          found.part = p;
        }
      }
    }
    return found;
  }

  static std::int64_t newest_step(const std::vector<RankRecord>& records) {
    std::int64_t step = 0;
    for (const RankRecord& record : records) step = std::max(step, record.step);
    return step;
  }
  static double total(const std::vector<double>& parts) {
    double sum = 0.0;
    for (double value : parts) sum += value;
    return sum;
  }
  static double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    const std::size_t n = values.size();
    return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
  }
  static std::string seconds_text(double seconds) {
    char text[32];
    std::snprintf(text, sizeof text, "%.0f s", seconds);
    return text;
  }
  std::string line_head(int rank) const {
    const auto who = who_.find(rank);
    return "trainloop: straggler: rank " + std::to_string(rank) + " (pid " +
           (who != who_.end() ? std::to_string(who->second.first) + ", host " + who->second.second : std::string("?")) + ")";
  }

  StragglerOptions options_;
  std::map<int, Sums> last_;                               // each rank's sums at its last reading with new steps
  std::map<int, std::pair<long, std::string>> who_;        // pid and host
  int candidate_ = -1;                                     // the rank past the thresholds in the last reading
  int in_a_row_ = 0;                                       // readings in a row it was
  int named_ = -1;                                         // the rank named now
  int clear_in_a_row_ = 0;                                 // readings in a row the named one was not past them
  std::chrono::steady_clock::time_point named_since_{};
  std::chrono::steady_clock::time_point last_line_{};
  StragglerRecord named_record_;                           // the named one's last naming
  std::vector<StragglerRecord> records_;                   // logged since take_records()
};

}  // namespace trainloop::distributed
