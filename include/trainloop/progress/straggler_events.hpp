#pragma once
/// @file
/// @brief From the main process's watchdog thread, which names a straggler
/// (distributed/watch/straggler_watch.hpp), to its training thread, which records it in the History
/// and tells the callbacks (Callback::on_straggler) at the next step boundary: a queue both threads
/// may use, one per process (only rank 0's watchdog posts).

#include <trainloop/history.hpp>

#include <mutex>
#include <utility>
#include <vector>

namespace trainloop::progress {

/// @brief Straggler records waiting for the training thread (see the file comment).
class StragglerEvents {
 public:
  /// Leaves `record` for the training thread (the watchdog thread).
  void post(StragglerRecord record) {
    std::lock_guard<std::mutex> lock(mutex_);
    waiting_.push_back(std::move(record));
  }
  /// Every record posted since the last take, oldest first (the training thread).
  std::vector<StragglerRecord> take() {
    std::lock_guard<std::mutex> lock(mutex_);
    return std::exchange(waiting_, {});
  }

 private:
  std::mutex mutex_;
  std::vector<StragglerRecord> waiting_;
};

/// @brief This process's queue.
inline StragglerEvents& straggler_events() {
  static StragglerEvents events;
  return events;
}

}  // namespace trainloop::progress
