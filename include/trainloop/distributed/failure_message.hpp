#pragma once
/// @file
/// @brief The message of a failed launch: which rank failed first, in its own words, how it
/// ended, and where its complete error text is kept.

#include <trainloop/distributed/failure_report.hpp>
#include <trainloop/distributed/launch_options.hpp>
#include <trainloop/distributed/posix_process.hpp>
#include <trainloop/distributed/run_directory.hpp>
#include <trainloop/error.hpp>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <iomanip>
#include <sstream>
#include <string>
#include <system_error>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace trainloop::distributed {

/// Several ranks seen failed in one poll: a rank whose error only reports a lost peer (a
/// collective that failed because another rank died, or death by SIGPIPE) comes after the others; among the rest,
/// crashes and early exits (no error file) first (their peers' errors are consequences), then
/// the earliest error file; ties by rank.
inline void order_by_first_failure(const std::string& run_dir, std::vector<const RankProcess*>& failed) {
  struct Key {
    int consequence;
    int has_file;
    std::filesystem::file_time_type written;
    int rank;
    bool operator<(const Key& other) const {
      return std::tie(consequence, has_file, written, rank) <
             std::tie(other.consequence, other.has_file, other.written, other.rank);
    }
  };
  auto key = [&](const RankProcess* process) {
    const RankErrorReport report = read_rank_error(run_dir, process->rank);
    std::error_code missing;
    auto time = std::filesystem::last_write_time(rank_error_path(run_dir, process->rank), missing);
    // A rank killed by SIGPIPE wrote to a socket whose peer was gone: a consequence too (a C++
    // program dies of it unless it ignores SIGPIPE; Gloo does not always send with MSG_NOSIGNAL).
    const bool consequence = report.consequence || process->signal == SIGPIPE;
    return Key{consequence ? 1 : 0, report.present ? 1 : 0,
               missing ? std::filesystem::file_time_type() : time, process->rank};
  };
  std::stable_sort(failed.begin(), failed.end(),
                   [&](const RankProcess* a, const RankProcess* b) { return key(a) < key(b); });
}

/// Keeps the failed rank's complete error text (with backtrace) after the run directory is
/// removed: copied into `keep_dir` as trainloop-error-rank\<N\>-XXXXXX.txt. "" when there is none.
inline std::string keep_full_error(const std::string& run_dir, int rank, const std::filesystem::path& keep_dir) {
  const auto source = rank_full_error_path(run_dir, rank);
  std::error_code error;
  if (!std::filesystem::exists(source, error)) return {};
  std::string pattern = (keep_dir / ("trainloop-error-rank" + std::to_string(rank) + "-XXXXXX.txt")).string();
  const int fd = ::mkstemps(pattern.data(), 4);
  if (fd < 0) return {};
  ::close(fd);
  std::filesystem::copy_file(source, pattern, std::filesystem::copy_options::overwrite_existing, error);
  return error ? std::string() : pattern;
}

/// The error for a failed launch: leads with the first failed rank (see order_by_first_failure)
/// and its own error text, then how it ended, where its complete error is, the other failures.
inline RankFailedError rank_failure_error(const std::string& run_dir, const LaunchOptions& options,
                                          const std::vector<RankProcess>& ranks,
                                          const std::vector<const RankProcess*>& failed) {
  const RankProcess& first = *failed.front();
  const RankErrorReport report = read_rank_error(run_dir, first.rank);
  RankFailedError::Details details;
  details.rank = first.rank;
  details.exit_code = first.exit_code;
  details.signal = first.signal;
  details.rank_error = report.message;
  details.error_type = report.type;
  details.full_error_file = keep_full_error(
      run_dir, first.rank, options.error_file_dir().empty() ? temporary_root() : std::filesystem::path(options.error_file_dir()));

  std::ostringstream message;
  message << "trainloop: rank " << first.rank << " failed: ";
  if (report.present) {
    message << report.message;  // the rank's own words first: what the user needs to fix
  } else {
    message << first.describe();
  }
  message << "\n  rank " << first.rank << " (local rank " << first.local_rank << " on node "
          << options.node_rank() << ", pid " << first.pid << ") " << first.describe() << " after "
          << std::fixed << std::setprecision(2) << first.wall_seconds << " s";
  if (!details.full_error_file.empty()) {
    message << "; its complete error with backtrace: " << details.full_error_file;
  } else if (!report.present && options.log_to_files()) {
    const std::string log = run_dir + "/rank" + std::to_string(first.rank) + ".log";
    const std::string output = detail::read_tail(log, 2000);
    message << "; it left no error message; "
            << (output.empty() ? "its output (" + log + ") is empty"
                               : "the end of its output (" + log + "):\n" + output);
  } else if (!report.present && !first.ended_early) {
    message << "; it left no error message (a crash or a signal; its output above may say more)";
  }
  for (std::size_t i = 1; i < failed.size(); ++i) {
    const RankErrorReport other = read_rank_error(run_dir, failed[i]->rank);
    message << "\n  also failed: rank " << failed[i]->rank << " (" << failed[i]->describe();
    if (other.present) {
      message << (other.consequence ? "; a consequence: " : ": ")
              << other.message.substr(0, other.message.find('\n'));
    }
    message << ")";
  }
  int stopped = 0;
  for (const auto& process : ranks) stopped += process.stopped_by_launcher ? 1 : 0;
  if (stopped > 0) {
    message << "\n  the other " << stopped << " running rank(s) were stopped (SIGTERM, then "
            << "SIGKILL after " << options.grace_period().count() << " ms)";
  }
  return RankFailedError(message.str(), std::move(details));
}

}  // namespace trainloop::distributed
