#pragma once
/// @file
/// @brief How the ranks' checkpoint writers tell rank 0's that their files are written, without a
/// collective: each rank posts a short message under a key, rank 0's writer polls for it. A
/// process group's collectives run in one order on every rank, so a writer behind training must
/// not start one (it would interleave with the training thread's); the job's key-value store
/// (c10d's TCPStore: thread-safe, a store op is not a collective) carries these messages. The
/// engine provides it (engine/optional_members.hpp: checkpoint_mailbox); a job of one process has
/// none and needs none.

#include <functional>
#include <optional>
#include <string>

namespace trainloop::detail {

/// @brief Messages between the ranks' checkpoint writers (see the file comment).
struct CheckpointMailbox {
  /// Leaves `value` under `key` for rank 0 to take.
  std::function<void(const std::string& key, const std::string& value)> post;
  /// The value posted under `key` (removing it), or nothing yet; never blocks.
  std::function<std::optional<std::string>(const std::string& key)> take;

  /// Whether there is one (a job of several processes).
  explicit operator bool() const { return post && take; }
};

}  // namespace trainloop::detail
