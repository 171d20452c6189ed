#pragma once
/// @file
/// @brief The files through which a spawned rank tells its launcher how it ended, and how the
/// launcher turns them into the error the user sees.
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

#include <trainloop/error.hpp>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

namespace trainloop::distributed {

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

}  // namespace trainloop::distributed
