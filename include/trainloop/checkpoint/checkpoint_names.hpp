#pragma once
/// @file
/// @brief The names of checkpoint files and how to find the newest: `epoch=0003-step=000120.ckpt`
/// (periodic), `best-epoch=0003-val_accuracy=0.9123.ckpt` (best by a monitored value), and
/// `last.ckpt` (a symbolic link to the newest); each a file, or, written by a sharded mode, a
/// directory of per-rank files. What a name says is all a reader needs to order
/// them: no file is opened.

#include <trainloop/detail/atomic_file.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief The name of the symbolic link to a directory's newest checkpoint.
inline constexpr const char* kLastCheckpointName = "last.ckpt";

/// @brief `epoch=0003-step=000120.ckpt`: the periodic checkpoint written at that position.
inline std::string periodic_checkpoint_name(int64_t epoch, int64_t global_step) {
  std::ostringstream name;
  name << "epoch=" << std::setw(4) << std::setfill('0') << epoch << "-step=" << std::setw(6) << global_step << ".ckpt";
  return name.str();
}

/// @brief `best-epoch=0003-val_accuracy=0.9123.ckpt`: the best checkpoint of an epoch by `monitor`.
inline std::string best_checkpoint_name(int64_t epoch, const std::string& monitor, double value) {
  std::ostringstream name;
  name << "best-epoch=" << std::setw(4) << std::setfill('0') << epoch << '-' << monitor << '=' << std::fixed
       << std::setprecision(4) << value << ".ckpt";
  return name.str();
}

namespace detail {

/// Reads the digits at the front of `text` into `value` and drops them; false when there are none.
inline bool take_number(std::string_view& text, int64_t& value) {
  size_t digits = 0;
  value = 0;
  while (digits < text.size() && digits < 18 && std::isdigit(static_cast<unsigned char>(text[digits]))) {
    value = value * 10 + (text[digits] - '0');
    ++digits;
  }
  text.remove_prefix(digits);
  return digits > 0;
}

/// Drops `prefix` from the front of `text`; false when `text` does not start with it.
inline bool take_prefix(std::string_view& text, std::string_view prefix) {
  if (text.substr(0, prefix.size()) != prefix) return false;
  text.remove_prefix(prefix.size());
  return true;
}

}  // namespace detail

/// @brief Whether `path` is a per-rank checkpoint: a directory in torch.distributed.checkpoint's
/// layout (its `.metadata` beside the ranks' `__<rank>_0.distcp` files), as the sharded modes
/// write them (checkpoint/dcp_checkpoint.hpp), rather than a directory of checkpoints.
inline bool is_sharded_checkpoint(const std::filesystem::path& path) {
  std::error_code ignored;
  return std::filesystem::is_directory(path, ignored) && std::filesystem::is_regular_file(path / ".metadata", ignored);
}

/// @brief Where in training a checkpoint file was written, read from its name.
struct CheckpointPosition {
  int64_t epoch = -1;  ///< the epoch in its name
  /// The global step in its name; a best checkpoint (written at its epoch's end) counts as the
  /// last step of that epoch, so it orders after the periodic ones inside that epoch.
  int64_t step = -1;
  bool best = false;  ///< a best-by-monitor checkpoint (else periodic)
};

/// @brief The position in a checkpoint file name written by ModelCheckpoint, or nothing when
/// `file_name` is not one (`last.ckpt`, temporary files, anyone else's files). With `monitor`
/// given, a best checkpoint must be of that monitored value.
inline std::optional<CheckpointPosition> parse_checkpoint_name(std::string_view file_name,
                                                               std::string_view monitor = {}) {
  CheckpointPosition position;
  std::string_view rest = file_name;
  if (rest.size() < 5 || rest.substr(rest.size() - 5) != ".ckpt") return std::nullopt;
  rest.remove_suffix(5);
  if (detail::take_prefix(rest, "epoch=")) {
    if (!detail::take_number(rest, position.epoch) || !detail::take_prefix(rest, "-step=") ||
        !detail::take_number(rest, position.step) || !rest.empty()) {
      return std::nullopt;
    }
    return position;
  }
  if (!detail::take_prefix(rest, "best-epoch=") || !detail::take_number(rest, position.epoch) ||
      !detail::take_prefix(rest, "-")) {
    return std::nullopt;
  }
  // "<monitor>=<value>": the value is the text after the last '='.
  const auto equals = rest.rfind('=');
  if (equals == std::string_view::npos || equals == 0) return std::nullopt;
  if (!monitor.empty() && rest.substr(0, equals) != monitor) return std::nullopt;
  const std::string_view value = rest.substr(equals + 1);
  if (value.empty() || value.find_first_not_of("-+.0123456789e") != std::string_view::npos) return std::nullopt;
  position.best = true;
  position.step = std::numeric_limits<int64_t>::max();
  return position;
}

/// @brief Whether checkpoint position `a` is newer than `b` (by epoch, then step).
inline bool newer(const CheckpointPosition& a, const CheckpointPosition& b) {
  return a.epoch != b.epoch ? a.epoch > b.epoch : a.step > b.step;
}

/// @brief The checkpoints in `directory`, newest first by the position in their names, so the
/// newest complete checkpoint comes first whatever `last.ckpt` points at (a kill between a
/// write and the update of the link leaves it pointing at the older one). Temporary files are
/// never listed. A `last.ckpt` that is a regular file rather than a link (copied with its
/// content) comes after the named ones, as a last resort.
inline std::vector<std::filesystem::path> checkpoint_candidates(const std::filesystem::path& directory) {
  std::vector<std::pair<CheckpointPosition, std::filesystem::path>> found;
  std::error_code error;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (detail::is_temporary_name(name)) continue;
    if (const auto position = parse_checkpoint_name(name)) found.emplace_back(*position, it->path());
  }
  // Newest first; for one position, the file names in a fixed order (a periodic and a best
  // checkpoint of one epoch end hold the same state).
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) {
    if (newer(a.first, b.first) || newer(b.first, a.first)) return newer(a.first, b.first);
    return a.second < b.second;
  });
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : found) paths.push_back(entry.second);
  const auto last = directory / kLastCheckpointName;
  std::error_code ignored;
  const auto status = std::filesystem::symlink_status(last, ignored);
  if (std::filesystem::is_regular_file(status) || (std::filesystem::is_directory(status) && is_sharded_checkpoint(last))) {
    paths.push_back(last);
  }
  return paths;
}

}  // namespace trainloop
