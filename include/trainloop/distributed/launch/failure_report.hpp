#pragma once
/// @file
/// @brief A failed rank's report, in one place: the files a spawned rank writes to tell its
/// launcher how it ended (rank side), and how the launcher reads them, finds the rank that failed
/// first and words the error the user sees (launcher side).
///
/// In the run directory, rank N writes (each file atomically):
/// - `rankN.error`: `type: <C++ type>`, `consequence: 0|1`, then its message without libtorch's
///   backtrace. `consequence: 1` marks an error that only reports another rank's failure (a
///   collective that lost its peer: "Connection reset by peer", a timeout), so the launcher names
///   the rank that failed first, not the one that noticed.
/// - `rankN.error.full`: the complete text, backtrace included; the launcher keeps it in a file
///   named in its message.
/// - `rankN.done`: written when the rank finished its work; a rank that exits 0 without it ended
///   early (e.g. user code called exit(0)).
///
/// This header needs no libtorch: tests/launcher_child uses it without linking it.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/type_name.hpp>
#include <trainloop/distributed/launch/posix_process.hpp>
#include <trainloop/distributed/launch/run_directory.hpp>
#include <trainloop/error.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <tuple>
#include <unistd.h>
#include <vector>

namespace trainloop::distributed {

// ---- The files

/// Path of the file where rank `rank` leaves its error text for the launcher.
inline std::filesystem::path rank_error_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / ("rank" + std::to_string(rank) + ".error");
}
/// Path of the file with rank `rank`'s complete error text (backtrace included).
inline std::filesystem::path rank_full_error_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / ("rank" + std::to_string(rank) + ".error.full");
}
/// Path of the marker rank `rank` writes when its work is done.
inline std::filesystem::path rank_done_path(const std::filesystem::path& run_dir, int rank) {
  return run_dir / ("rank" + std::to_string(rank) + ".done");
}

/// What a rank reported about its failure.
struct RankErrorReport {
  bool present = false;      ///< the rank wrote an error file
  std::string type;          ///< C++ type of its exception
  bool consequence = false;  ///< it only reports another rank's failure
  std::string message;       ///< its message, without backtrace
};

/// True for error texts that only say a peer went away or did not answer: what the surviving
/// ranks of a job report after one rank crashed (Gloo: "Connection reset by peer", "Connection
/// closed by peer"; a collective's or the store's timeout; NCCL: a communicator aborted).
inline bool is_peer_failure_text(std::string_view text) {
  static constexpr std::string_view kMarkers[] = {
      "Connection reset by peer", "Connection closed by peer", "Broken pipe", "Socket Timeout",
      "Timed out waiting",        "timed out",                 "NCCL communicator was aborted",
      "ncclRemoteError",          "Connection refused",
      // trainloop's own words for a collective decision another rank's failure forced (a
      // checkpoint another rank could not write): that rank's error is the one to report.
      "another rank could not"};
  for (auto marker : kMarkers) {
    if (text.find(marker) != std::string_view::npos) return true;
  }
  return false;
}

/// Reads rank `rank`'s error file (present = false when it wrote none).
inline RankErrorReport read_rank_error(const std::filesystem::path& run_dir, int rank) {
  RankErrorReport report;
  std::ifstream in(rank_error_path(run_dir, rank));
  if (!in) return report;
  report.present = true;
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("type: ", 0) == 0) {
      report.type = line.substr(6);
    } else if (line.rfind("consequence: ", 0) == 0) {
      report.consequence = line.substr(13) == "1";
    } else {
      report.message = line + '\n';
      break;
    }
  }
  report.message.append(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  while (!report.message.empty() && (report.message.back() == '\n' || report.message.back() == ' ')) {
    report.message.pop_back();
  }
  return report;
}

/// The error file's text for an exception of type `type` with message `message`.
inline std::string format_rank_error(const std::string& type, bool consequence, const std::string& message) {
  return "type: " + type + "\nconsequence: " + (consequence ? "1" : "0") + "\n" + message + "\n";
}

// ---- Rank side: how a rank reports its end

/// How a rank's exception is reported (the files above).
struct FailureDescription {
  std::string type;          ///< C++ type of the exception
  std::string message;       ///< what the user should read first (no backtrace)
  std::string full_text;     ///< everything, backtrace included
  bool consequence = false;  ///< it only reports another rank's failure
};

/// Describes any std::exception: its demangled type, its text and whether it is a
/// CommunicationError or reads like a lost peer. `message_of` gives what the user reads first,
/// `full_text_of` everything: plain what() by default (the launcher's test child links no
/// libtorch); a DDP rank passes libtorch-aware ones that move the backtrace to the full text.
inline FailureDescription describe_exception(const std::exception& error,
                                             std::string (*message_of)(const std::exception&) = nullptr,
                                             std::string (*full_text_of)(const std::exception&) = nullptr) {
  FailureDescription description;
  description.type = ::trainloop::detail::error_type_name(error);
  description.message = message_of != nullptr ? message_of(error) : std::string(error.what());
  description.full_text = full_text_of != nullptr ? full_text_of(error) : std::string(error.what());
  description.consequence =
      dynamic_cast<const CommunicationError*>(&error) != nullptr || is_peer_failure_text(description.message);
  return description;
}

/// Writes `<run_dir>/rank<rank>.error` and `.error.full` (atomically, so the launcher never reads
/// half a message) and prints the message on this rank's stderr. Never throws: it runs while a
/// failure is already being handled.
inline void report_rank_failure(const std::string& run_dir, int rank, const FailureDescription& failure) noexcept {
  std::fprintf(stderr, "trainloop: rank %d failed: %s\n", rank, failure.message.c_str());
  std::fflush(stderr);
  if (run_dir.empty()) return;
  try {
    ::trainloop::detail::write_file_atomically(rank_full_error_path(run_dir, rank), failure.full_text + "\n",
                                               "the rank's error text");
    ::trainloop::detail::write_file_atomically(
        rank_error_path(run_dir, rank), format_rank_error(failure.type, failure.consequence, failure.message),
        "the rank's error report");
  } catch (...) {
  }
}

// ---- Launcher side: which rank failed first, and the error the user sees

/// What the launcher's error message needs of its options (LaunchOptions, which needs libtorch's
/// TORCH_ARG, stays out of this header).
struct FailureContext {
  int node_rank = 0;                        ///< this launcher's node
  std::filesystem::path error_file_dir;     ///< where the failed rank's full error is kept ("" = temp root)
  bool log_to_files = false;                ///< ranks' output went to rank<N>.log in the run directory
  std::chrono::milliseconds grace_period{}; ///< SIGTERM-to-SIGKILL wait for the other ranks
};

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
/// removed: copied into `keep_dir` as trainloop-error-rank\<N\>-XXXXXX.txt. "" when there is none,
/// or when it says no more than `message`, which the launcher's error already holds (a stall's
/// verdict, an exception without backtrace or cause): a file kept for nothing was left behind by
/// every stall (issue 50).
inline std::string keep_full_error(const std::string& run_dir, int rank, const std::filesystem::path& keep_dir,
                                   const std::string& message) {
  const auto source = rank_full_error_path(run_dir, rank);
  std::error_code error;
  if (!std::filesystem::exists(source, error)) return {};
  {
    std::ifstream in(source, std::ios::binary);
    std::string full((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    while (!full.empty() && (full.back() == '\n' || full.back() == ' ')) full.pop_back();
    if (full.empty() || full == message) return {};
  }
  std::string pattern = (keep_dir / ("trainloop-error-rank" + std::to_string(rank) + "-XXXXXX.txt")).string();
  const int fd = ::mkstemps(pattern.data(), 4);
  if (fd < 0) return {};
  ::close(fd);
  std::filesystem::copy_file(source, pattern, std::filesystem::copy_options::overwrite_existing, error);
  return error ? std::string() : pattern;
}

/// The error for a failed launch: leads with the first failed rank (see order_by_first_failure)
/// and its own error text, then how it ended, where its complete error is, the other failures.
inline RankFailedError rank_failure_error(const std::string& run_dir, const FailureContext& options,
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
      run_dir, first.rank, options.error_file_dir.empty() ? temporary_root() : options.error_file_dir, report.message);

  std::ostringstream message;
  message << "trainloop: rank " << first.rank << " failed: ";
  if (report.present) {
    message << report.message;  // the rank's own words first: what the user needs to fix
  } else {
    message << first.describe();
  }
  message << "\n  rank " << first.rank << " (local rank " << first.local_rank << " on node "
          << options.node_rank << ", pid " << first.pid << ") " << first.describe() << " after "
          << std::fixed << std::setprecision(2) << first.wall_seconds << " s";
  if (!details.full_error_file.empty()) {
    message << "; its complete error with backtrace: " << details.full_error_file;
  } else if (!report.present && options.log_to_files) {
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
            << "SIGKILL after " << options.grace_period.count() << " ms)";
  }
  return RankFailedError(message.str(), std::move(details));
}

}  // namespace trainloop::distributed
