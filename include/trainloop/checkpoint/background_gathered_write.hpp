#pragma once
/// @file
/// @brief A gathered checkpoint (one file, written by rank 0: the replicated modes) written behind
/// training by a thread of its own, with every guarantee of the foreground write
/// (checkpoint/checkpoint_file.hpp): the same layout and values, atomic, fsynced.
///
/// 1. (training thread, before) the archive is built: the parameters and the optimizer state as
///    views, the buffers copied (checkpoint/module_snapshot.hpp), the rest taken as values;
/// 2. the thread streams it into a temporary file next to the checkpoint — the training thread
///    waits for that (wait_copied) only before its next optimizer step changes what it reads;
/// 3. it fsyncs and renames the file (the commit), or removes it on a failure.
///
/// A kill at any moment leaves the previous checkpoint whole (the name appears only at the rename)
/// and at most a temporary file, which the next writer in that directory removes once its owner is
/// dead. The other ranks have nothing to write: their part is finished at once.

#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

namespace trainloop::detail {

/// @brief A gathered checkpoint's file written by a thread of its own (see the file comment).
class BackgroundGatheredWrite : public BackgroundWrite {
 public:
  /// Starts the thread writing `archive` to `path` when this rank `writes` it; otherwise the write
  /// is finished at once. `step`: the optimizer steps it holds (the test kill point's step).
  BackgroundGatheredWrite(torch::serialize::OutputArchive archive, std::filesystem::path path, int64_t step, bool writes)
      : archive_(std::move(archive)), path_(std::move(path)), step_(step) {
    if (!writes) {
      copied_ = true;
      finished_.store(true);
      return;
    }
    thread_ = std::thread([this] { run(); });
  }
  BackgroundGatheredWrite(const BackgroundGatheredWrite&) = delete;
  BackgroundGatheredWrite& operator=(const BackgroundGatheredWrite&) = delete;
  ~BackgroundGatheredWrite() override { cancel(); }

  void wait_copied() override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return copied_; });
  }
  bool finished() const override { return finished_.load(); }
  void wait_finished() override {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [this] { return finished_.load(); });
  }
  std::exception_ptr join() override {
    if (thread_.joinable()) thread_.join();
    return error_;
  }
  /// The file streamed so far is not committed (the temporary file is removed); a write already
  /// committed stays.
  void cancel() override {
    cancelled_.store(true);
    if (thread_.joinable()) thread_.join();
  }

 private:
  void run() {
    try {
      save_checkpoint_archive(archive_, path_, [this] {
        set_copied();
        progress::test_kill_point(progress::KillPoint::BackgroundWrite, step_);
        if (cancelled_.load()) throw CheckpointError("trainloop: the checkpoint write was cancelled (fit() ended with an error)");
      });
    } catch (...) {
      error_ = checkpoint_failure(path_);
    }
    set_copied();
    archive_ = torch::serialize::OutputArchive();  // the buffers' copies go now, not at the next checkpoint
    std::lock_guard<std::mutex> lock(mutex_);
    finished_.store(true);
    changed_.notify_all();
  }

  void set_copied() {
    std::lock_guard<std::mutex> lock(mutex_);
    copied_ = true;
    changed_.notify_all();
  }

  torch::serialize::OutputArchive archive_;
  std::filesystem::path path_;
  int64_t step_ = 0;
  std::mutex mutex_;
  std::condition_variable changed_;
  bool copied_ = false;
  std::atomic<bool> finished_{false};
  std::atomic<bool> cancelled_{false};
  std::exception_ptr error_;
  std::thread thread_;  // last: starts once everything above is made
};

}  // namespace trainloop::detail
