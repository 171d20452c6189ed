#pragma once
/// @file
/// @brief One rank's part of a per-rank checkpoint written behind training, by a thread of its
/// own, with every guarantee of the foreground write (loop/sharded_checkpoint_io.hpp):
///
/// 1. (training thread, before) rank 0 made the temporary directory and wrote the loop's state
///    into it; every rank planned its ShareCapture (checkpoint/share_capture.hpp);
/// 2. the thread copies the rank's shares into the capture's host buffers — the training thread
///    waits for that (wait_copied) only before its next optimizer step changes them;
/// 3. it writes and fsyncs the rank's `__<rank>_0.distcp` from the buffers and posts its part of
///    the metadata (or its error) through the CheckpointMailbox — no collective;
/// 4. rank 0's thread takes every rank's part, merges them into `.metadata` and commits the
///    directory (detail/atomic_directory.hpp), or, when any rank failed, removes it.
///
/// A kill at any moment leaves the previous checkpoint whole (the directory appears only at the
/// commit) and at most a temporary directory, which the next writer removes once its owner is dead.
/// The loop (loop/background_checkpoint_io.hpp) decides with every rank, at a step boundary, when
/// the write is over, and reports its outcome there.

#include <trainloop/checkpoint/checkpoint_mailbox.hpp>
#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/atomic_directory.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// The current exception as a trainloop::Error: a CheckpointError naming `path` with the cause
/// nested, for what is not one already (an allocation, libtorch, the file system), so every
/// rank's failure is one ModelCheckpoint handles (stop_on_error off: every rank goes on).
inline std::exception_ptr checkpoint_failure(const std::filesystem::path& path) {
  try {
    throw;
  } catch (const Error&) {
    return std::current_exception();
  } catch (const std::exception& error) {
    try {
      std::throw_with_nested(CheckpointError(concat("trainloop: cannot write the checkpoint ", path.string(), ": ",
                                                    error.what(), "; the previous checkpoints are unchanged")));
    } catch (...) {
      return std::current_exception();
    }
  }
}

/// What `error` says (its what()).
inline std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& caught) {
    return caught.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

/// Writes `__<rank>_0.distcp` into `directory` from captured boxes (their buffers) and returns
/// its part of the metadata (write_checkpoint_metadata takes the parts back).
inline std::string write_captured_rank_file(const std::filesystem::path& directory, int rank,
                                            const std::vector<CapturedBox>& boxes) {
  serialization::dcp::DistcpWriter writer(directory, rank);
  for (const CapturedBox& box : boxes) writer.add_tensor_chunk(box.key, box.buffer, box.offsets, box.size);
  return serialization::dcp::metadata_pickle(writer.finish());
}

/// @brief Where a background write goes and who writes it.
struct BackgroundWriteSetup {
  std::filesystem::path temporary;  ///< the directory every rank writes its file into
  std::filesystem::path target;     ///< the checkpoint's name, where rank 0 commits it
  int rank = 0;                     ///< this rank
  int world_size = 1;               ///< ranks writing a file each
  int64_t step = 0;                 ///< the optimizer steps the checkpoint holds (the test kill point's step)
  std::string mailbox_key;          ///< unique per checkpoint: rank r posts under `<key>/<r>`
};

/// @brief A checkpoint being written by a thread of its own, as the loop sees it
/// (loop/background_checkpoint_io.hpp): this rank's part of a per-rank checkpoint
/// (BackgroundCheckpointWrite) or a gathered checkpoint's file (BackgroundGatheredWrite). The
/// thread and what the training thread waits for live here; a writer says what its thread does
/// (run()), starts it last in its constructor (start()) and cancels it first in its destructor.
class BackgroundWrite {
 public:
  BackgroundWrite(const BackgroundWrite&) = delete;
  BackgroundWrite& operator=(const BackgroundWrite&) = delete;
  virtual ~BackgroundWrite() = default;

  /// Blocks until the thread no longer reads the state training changes (the training thread,
  /// before its next optimizer step). Returns at once after that, and after a failure.
  void wait_copied() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return copied_; });
  }
  /// Rank 0: whether the checkpoint is committed or given up (then join() returns at once). Other
  /// ranks: whether their part is done.
  bool finished() const { return finished_.load(); }
  /// Blocks until finished() (no collective).
  void wait_finished() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return finished_.load(); });
  }
  /// Waits for the thread; returns this rank's error, null when its part succeeded (rank 0 of a
  /// per-rank checkpoint: committed; its error names any rank that failed).
  std::exception_ptr join() {
    if (thread_.joinable()) thread_.join();
    return error_;
  }
  /// Ends the thread without committing (fit() failed): it stops waiting for the others and
  /// stops streaming; what it wrote is removed, a write already committed stays. No collective.
  void cancel() {
    cancelled_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 protected:
  BackgroundWrite() = default;

  /// Starts the thread running `work`, then marks the write copied and finished however it ended.
  template <class Work>
  void start(Work work) {
    thread_ = std::thread([this, work = std::move(work)]() mutable {
      work();
      set_copied();
      std::lock_guard<std::mutex> lock(mutex_);
      finished_.store(true);
      changed_.notify_all();
    });
  }
  /// No thread: nothing to write on this rank; finished at once.
  void finish_at_once() {
    copied_ = true;
    finished_.store(true);
  }
  /// The training thread may change the state from now on.
  void set_copied() {
    std::lock_guard<std::mutex> lock(mutex_);
    copied_ = true;
    changed_.notify_all();
  }
  /// Whether cancel() was called.
  bool cancelled() const { return cancelled_.load(); }
  /// The flag cancel() sets, for work that polls it (a copy, a stream).
  const std::atomic<bool>& cancel_flag() const { return cancelled_; }

  std::exception_ptr error_;  ///< this rank's failure (the thread's; read after join())

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  bool copied_ = false;
  std::atomic<bool> finished_{false};
  std::atomic<bool> cancelled_{false};
  std::thread thread_;
};

/// @brief This rank's part of a checkpoint written by a thread of its own (see the file comment).
class BackgroundCheckpointWrite : public BackgroundWrite {
 public:
  /// Starts the thread. `capture` was planned for this checkpoint and outlives the write.
  BackgroundCheckpointWrite(BackgroundWriteSetup setup, ShareCapture& capture, CheckpointMailbox mailbox)
      : setup_(std::move(setup)), capture_(capture), mailbox_(std::move(mailbox)) {
    start([this] { run(); });
  }
  ~BackgroundCheckpointWrite() override { cancel(); }

 private:
  void run() {
    std::string part;
    try {
      const bool copied = capture_.copy(cancel_flag());
      set_copied();
      if (!copied) throw CheckpointError("trainloop: the checkpoint write was cancelled (fit() ended with an error)");
      part = write_captured_rank_file(setup_.temporary, setup_.rank, capture_.boxes());
      progress::test_kill_point(progress::KillPoint::BackgroundWrite, setup_.step);
    } catch (...) {
      set_copied();
      error_ = checkpoint_failure(setup_.target);
    }
    if (setup_.rank != 0) {
      try {
        mailbox_.post(setup_.mailbox_key + "/" + std::to_string(setup_.rank), error_ ? "F" + error_text(error_) : "K" + part);
      } catch (...) {
        if (!error_) error_ = checkpoint_failure(setup_.target);
      }
    } else {
      commit_on_rank_zero(std::move(part));
    }
  }

  /// Rank 0: every rank's part, then the metadata and the commit — or the directory removed.
  void commit_on_rank_zero(std::string own_part) {
    std::vector<std::string> parts(static_cast<size_t>(setup_.world_size));
    parts[0] = std::move(own_part);
    std::string failure;
    try {
      collect_parts(parts, failure);
    } catch (...) {  // the store gone (its host lost): the write fails, the thread ends
      if (!error_) error_ = checkpoint_failure(setup_.target);
    }
    try {
      if (error_) std::rethrow_exception(error_);
      if (cancelled()) throw CheckpointError("trainloop: the checkpoint write was cancelled (fit() ended with an error)");
      if (!failure.empty()) {
        throw CheckpointError(concat("trainloop: another rank could not write its share of the checkpoint ",
                                     setup_.target.string(), " (", failure, "); nothing was committed, the previous "
                                     "checkpoints are unchanged"));
      }
      write_checkpoint_metadata(setup_.temporary, parts, setup_.target.string());
      commit_directory(setup_.temporary, setup_.target);
    } catch (...) {
      if (!error_) error_ = checkpoint_failure(setup_.target);
      std::error_code ignored;
      std::filesystem::remove_all(setup_.temporary, ignored);
    }
  }

  /// Rank 0: what every other rank posted, its part or its failure (the first named in `failure`);
  /// stops early when cancelled.
  void collect_parts(std::vector<std::string>& parts, std::string& failure) {
    for (int r = 1; r < setup_.world_size; ++r) {
      const std::string key = setup_.mailbox_key + "/" + std::to_string(r);
      std::optional<std::string> message;
      // Polled (a blocking store read would hold the store's client while the training thread
      // and the watchdog use it); the first reply is usually in already.
      for (auto pause = std::chrono::milliseconds(1); !(message = mailbox_.take(key));
           pause = std::min(pause * 2, std::chrono::milliseconds(20))) {
        if (cancelled()) return;
        std::this_thread::sleep_for(pause);
      }
      if (message->empty() || message->front() != 'K') {
        if (failure.empty()) failure = concat("rank ", r, ": ", message->empty() ? std::string("no reason") : message->substr(1));
        continue;
      }
      parts[static_cast<size_t>(r)] = message->substr(1);
    }
  }

  BackgroundWriteSetup setup_;
  ShareCapture& capture_;
  CheckpointMailbox mailbox_;
};

}  // namespace trainloop::detail
