#pragma once
/// @file
/// @brief A gathered checkpoint (one file, written by rank 0: the replicated modes) written behind
/// training by a thread of its own, with every guarantee of the foreground write
/// (checkpoint/checkpoint_file.hpp): the same layout and values, atomic, fsynced.
///
/// 1. (training thread, before) the archive is built: host buffers standing in for the parameters
///    and the optimizer state (checkpoint/gathered_capture.hpp), the model's buffers copied
///    (checkpoint/module_snapshot.hpp), the rest taken as values;
/// 2. the thread copies the live parameters and optimizer state into those buffers — the training
///    thread waits for that (wait_copied) only before its next optimizer step changes them; where
///    the archive holds a live tensor instead (GatheredCapture::complete() false), it waits until
///    the archive is streamed;
/// 3. it streams the archive into a temporary file next to the checkpoint, fsyncs and renames it
///    (the commit), or removes it on a failure.
///
/// A kill at any moment leaves the previous checkpoint whole (the name appears only at the rename)
/// and at most a temporary file, which the next writer in that directory removes once its owner is
/// dead. The other ranks have nothing to write: their part is finished at once.

#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/checkpoint/gathered_capture.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <utility>

namespace trainloop::detail {

/// @brief A gathered checkpoint's file written by a thread of its own (see the file comment).
class BackgroundGatheredWrite : public BackgroundWrite {
 public:
  /// Starts the thread writing `archive` to `path` when this rank `writes` it; otherwise the write
  /// is finished at once. `capture`: the buffers standing in for live tensors in `archive` (it
  /// outlives the write); `step`: the optimizer steps it holds (the test kill point's step).
  BackgroundGatheredWrite(torch::serialize::OutputArchive archive, GatheredCapture& capture, std::filesystem::path path,
                          int64_t step, bool writes)
      : archive_(std::move(archive)), capture_(capture), path_(std::move(path)), step_(step) {
    if (writes) {
      start([this] { run(); });
    } else {
      finish_at_once();
    }
  }
  ~BackgroundGatheredWrite() override { cancel(); }

 private:
  void run() {
    try {
      if (!capture_.copy(cancel_flag())) {
        throw CheckpointError("trainloop: the checkpoint write was cancelled (fit() ended with an error)");
      }
      if (capture_.complete()) set_copied();  // the archive holds no live tensor the step changes
      // A cancel stops the writing (save_checkpoint_archive's `stop`): a fit that failed does not
      // wait for the rest of a large file to reach the disk.
      save_checkpoint_archive(archive_, path_, [this] {
        set_copied();
        progress::test_kill_point(progress::KillPoint::BackgroundWrite, step_);
        if (cancelled()) throw CheckpointError("trainloop: the checkpoint write was cancelled (fit() ended with an error)");
      }, &cancel_flag());
    } catch (...) {
      error_ = checkpoint_failure(path_);
    }
    set_copied();
    archive_ = torch::serialize::OutputArchive();  // the buffers' copies go now, not at the next checkpoint
  }

  torch::serialize::OutputArchive archive_;
  GatheredCapture& capture_;
  std::filesystem::path path_;
  int64_t step_ = 0;
};

}  // namespace trainloop::detail
