#define BOOST_TEST_MODULE test_stragglers
#include "unit_test.hpp"

#include "test_paths.hpp"

// A rank that is slow but not stalled (distributed/watch/straggler_watch.hpp): every rank's own time
// per step part (its waits in collectives left out) travels with its watchdog record, and the main
// process names the rank that trails, with the part where it loses time, within 20 steps; a clean
// run names nobody. ddp_worker's "slow" scenario sleeps on one rank in its input, forward or
// backward (TL_TEST_SLOW); the comparison itself is tested on records made here.

#include "ddp_test_support.hpp"

#include <trainloop/distributed/watch/straggler_watch.hpp>

#include <chrono>
#include <fstream>
#include <regex>
#include <string>
#include <vector>

namespace {

using trainloop::distributed::RankRecord;
using trainloop::distributed::StragglerOptions;
using trainloop::distributed::StragglerWatch;

/// Rank `rank`'s record after `steps` steps with these seconds per step in input, forward,
/// backward and optimizer.
RankRecord record(int rank, std::int64_t steps, std::vector<double> per_step) {
  RankRecord r;
  r.rank = rank;
  r.pid = 1000 + rank;
  r.host = "n" + std::to_string(rank);
  r.step = steps;
  r.steps_timed = steps;
  for (int p = 0; p < 4; ++p) r.part_seconds[p] = per_step[static_cast<size_t>(p)] * static_cast<double>(steps);
  return r;
}

/// The readings of `ranks` ranks, 10 steps each, rank `slow` (if any) `extra` seconds longer in `part`.
std::vector<std::vector<std::string>> readings(StragglerWatch& watch, int ranks, int count, int slow, int part,
                                               double extra, int first = 1) {
  std::vector<std::vector<std::string>> lines;
  const auto start = std::chrono::steady_clock::now();
  for (int reading = first; reading < first + count; ++reading) {
    std::vector<RankRecord> records;
    for (int rank = 0; rank < ranks; ++rank) {
      std::vector<double> parts{0.002, 0.010, 0.020, 0.004};
      if (rank == slow) parts[static_cast<size_t>(part)] += extra;
      records.push_back(record(rank, 10 * reading, parts));
    }
    lines.push_back(watch.update(records, start + std::chrono::seconds(reading)));
  }
  return lines;
}

/// The "slow" scenario on `world` ranks; the straggler line's rank, part and step.
struct Named {
  int rank = -1;
  std::string part;
  int step = -1;
  std::string output;
  int history_rank = -1;              ///< the first straggler in the History fit() returned
  double history_named = 0;           ///< namings in that History
  std::vector<std::string> callback;  ///< what Callback::on_straggler saw: "<rank> <part> <ended>"
};

Named run_slow(int world, const std::string& slow, int steps) {
  WorkerRun run = run_worker("slow", world, 0, "TL_TEST_STEPS=" + std::to_string(steps) + " TL_TEST_SLOW=" + slow,
                             "_" + std::to_string(world) + "_" + (slow.empty() ? "clean" : slow.substr(2, slow.rfind(':') - 2)));
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  Named named;
  named.output = run.output;
  std::smatch match;
  static const std::regex line("straggler: rank ([0-9]+) \\(pid [0-9]+, host [^)]+\\) \\+[0-9]+ ms per step in ([a-z]+) \\(step ([0-9]+)\\)");
  if (std::regex_search(run.output, match, line)) {
    named.rank = std::stoi(match[1]);
    named.part = match[2];
    named.step = std::stoi(match[3]);
  }
  named.history_rank = static_cast<int>(run.result["first_straggler_rank"]);
  named.history_named = run.result["stragglers_named"];
  std::ifstream seen(run.dir / "stragglers.txt");
  for (std::string line; std::getline(seen, line);) named.callback.push_back(line);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
  return named;
}

}  // namespace

BOOST_AUTO_TEST_CASE(the_rank_that_trails_is_named_with_its_part_after_three_readings) {
  StragglerWatch watch(StragglerOptions{});
  const auto lines = readings(watch, 3, 5, /*slow=*/2, /*part=*/2, /*extra=*/0.060);
  // The first reading only sets the baseline; the next three in a row name it, once.
  BOOST_TEST(lines[0].empty());
  BOOST_TEST(lines[1].empty());
  BOOST_TEST(lines[2].empty());
  BOOST_REQUIRE(lines[3].size() == 1u);
  BOOST_TEST(lines[3][0] == "trainloop: straggler: rank 2 (pid 1002, host n2) +60 ms per step in backward (step 40)");
  BOOST_TEST(lines[4].empty());  // named again only after a minute
  BOOST_TEST(watch.named() == 2);
}

BOOST_AUTO_TEST_CASE(equal_ranks_and_small_differences_name_nobody) {
  StragglerWatch equal(StragglerOptions{});
  for (const auto& lines : readings(equal, 3, 8, -1, 0, 0.0)) BOOST_TEST(lines.empty());
  // 20 ms more (below the 25 ms least excess), and 30 ms on a 400 ms step (below 20% of it).
  StragglerWatch small(StragglerOptions{});
  for (const auto& lines : readings(small, 2, 8, 1, 1, 0.020)) BOOST_TEST(lines.empty());
  StragglerOptions options;
  options.least_excess = std::chrono::milliseconds(25);
  StragglerWatch relative(options);
  std::vector<RankRecord> records;
  const auto start = std::chrono::steady_clock::now();
  for (int reading = 1; reading <= 8; ++reading) {
    records = {record(0, reading * 10, {0.1, 0.1, 0.15, 0.05}), record(1, reading * 10, {0.1, 0.13, 0.15, 0.05})};
    BOOST_TEST(relative.update(records, start + std::chrono::seconds(reading)).empty());
  }
}

BOOST_AUTO_TEST_CASE(a_straggler_that_recovers_is_said_to_and_one_that_lasts_is_named_again_after_a_minute) {
  StragglerWatch watch(StragglerOptions{});
  auto lines = readings(watch, 2, 4, 1, 0, 0.100);
  BOOST_REQUIRE(lines[3].size() == 1u);
  BOOST_TEST(lines[3][0].find("in input") != std::string::npos);
  lines = readings(watch, 2, 3, -1, 0, 0.0, 5);  // recovered: three clean readings
  BOOST_TEST(lines[0].empty());
  BOOST_TEST(lines[1].empty());
  BOOST_REQUIRE(lines[2].size() == 1u);
  BOOST_TEST(lines[2][0].find("rank 1 (pid 1001, host n1) no longer trails") != std::string::npos, lines[2][0]);
  BOOST_TEST(watch.named() == -1);
  StragglerWatch lasting(StragglerOptions{});
  lines = readings(lasting, 2, 70, 1, 3, 0.100);
  int named = 0;
  for (const auto& reading : lines) named += static_cast<int>(reading.size());
  BOOST_TEST(named == 2);  // at reading 4 and a minute later (readings one second apart)
}

BOOST_AUTO_TEST_CASE(a_rank_slowed_in_its_input_forward_or_backward_is_named_with_that_part_within_20_steps) {
  struct Case {
    int world;
    std::string slow;
    int rank;
    std::string part;
  };
  for (const Case& c : {Case{2, "1:input:60", 1, "input"}, Case{3, "2:forward:60", 2, "forward"},
                        Case{2, "1:backward:60", 1, "backward"}, Case{3, "1:backward:60", 1, "backward"}}) {
    const Named named = run_slow(c.world, c.slow, 40);
    BOOST_TEST_MESSAGE(c.world << " ranks, " << c.slow << ": named rank " << named.rank << " in " << named.part
                               << " at step " << named.step);
    BOOST_TEST(named.rank == c.rank, c.slow << "\n" << named.output);
    BOOST_TEST(named.part == c.part, c.slow << "\n" << named.output);
    BOOST_TEST((named.step >= 1 && named.step <= 20), c.slow << ": named at step " << named.step);
    // The History and the callbacks carry it too (the main process's, at a step boundary).
    BOOST_TEST(named.history_rank == c.rank);
    BOOST_TEST(named.history_named >= 1.0);
    BOOST_REQUIRE(!named.callback.empty());
    BOOST_TEST(named.callback.front() == std::to_string(c.rank) + " " + c.part + " 0");
  }
}

BOOST_AUTO_TEST_CASE(a_clean_200_step_run_names_nobody) {
  const Named named = run_slow(3, "", 200);
  BOOST_TEST(named.output.find("straggler:") == std::string::npos, named.output);
  BOOST_TEST(named.history_rank == -1);
  BOOST_TEST(named.callback.empty());
}
