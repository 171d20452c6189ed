#pragma once
/// @file
/// @brief CheckpointSource: where fit(..., "last") finds the checkpoints to resume from. The
/// resume logic asks this interface, not a concrete callback (ModelCheckpoint implements it; a
/// user's own checkpoint writer can too).

#include <filesystem>
#include <vector>

namespace trainloop {

/// @brief A writer of checkpoints that fit(..., "last") can resume from.
class CheckpointSource {
 public:
  virtual ~CheckpointSource() = default;
  /// @brief The checkpoints written so far, newest first (the first readable one is resumed).
  virtual std::vector<std::filesystem::path> candidates() const = 0;
  /// @brief The path that names the newest checkpoint (e.g. `dir/last.ckpt`), for messages.
  virtual std::filesystem::path last_path() const = 0;
};

}  // namespace trainloop
