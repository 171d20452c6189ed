#pragma once
/// @file
/// @brief Checkpoints written behind training (TrainState::start_checkpoint): the loop's side of
/// checkpoint/background_write.hpp (per-rank checkpoints) and background_gathered_write.hpp (a
/// gathered one, from a state of kGatheredBackgroundBytes up: loop/checkpoint_io.hpp). At the checkpoint's step, on the training thread, in
/// what every rank does alike: rank 0 makes the temporary directory (a small collective, as the
/// foreground write) and writes the loop's state into it (`trainloop.pt`, kilobytes), every rank
/// plans its capture; then its thread copies and writes while training goes on. The training
/// thread waits only
/// - before the next optimizer step (or anything else that changes the parameters or the
///   optimizer state in place: TrainState::restore_own_weights, free_whole_weights) until the
///   copy is done;
/// - at a checkpoint due while this one is still being written (back pressure: said once);
/// - at the end of fit(), for the last one.
/// The ranks agree the write is over at a step boundary: while one is in flight, one small
/// collective per optimizer step (rank 0 says whether its thread committed or gave up), and one
/// more where it ends (did any rank fail); its report goes to `done` there, on every rank.
/// Measured on 2 CPU ranks, the ~100 M-parameter MLP with Adam: benchmarks/README.md
/// ("checkpoint_stall").

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/checkpoint/background_gathered_write.hpp>
#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/sharded_members.hpp>
#include <trainloop/error.hpp>
#include <trainloop/loop/sharded_checkpoint_io.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// The checkpoint in flight, if any, and the host buffers every per-rank one reuses.
class BackgroundCheckpoints {
 public:
  /// Whether a checkpoint is being written.
  bool pending() const { return static_cast<bool>(write_); }

  /// Starts a per-rank checkpoint of `module` and `optimizer` at `target` written behind training
  /// (the file comment); `write_loop_state(file)` writes trainloop.pt on rank 0, now. A collective.
  /// @throws trainloop::CheckpointError on every rank when the start failed (nothing is written then).
  template <ModeEngine Engine, class Module>
  void start(Engine& engine, Module& module, torch::optim::Optimizer& optimizer, const std::filesystem::path& target,
             int64_t step, const std::function<void(const std::filesystem::path&)>& write_loop_state,
             std::function<void(const CheckpointReport&)> done) {
    make_room(engine);
    Stopwatch clock;
    const std::filesystem::path path = checkpoint_directory_name(target);
    const bool main = engine.rank() == 0;
    RemoveUnlessCommitted temporary = agreed_temporary_directory(engine, path);
    std::exception_ptr failure;
    try {
      if (main) write_loop_state(temporary.directory / kDcpLoopStateFile);
      UnshardedTensors whole;
      if (main) whole = unsharded_tensors(module, optimizer);
      capture_.plan(checkpoint_shares(engine, module, optimizer), whole.parameters, whole.buffers);
    } catch (...) {
      failure = checkpoint_failure(path);
    }
    agree_or_throw(engine, failure, path);
    BackgroundWriteSetup setup;
    setup.temporary = temporary.directory;
    setup.target = path;
    setup.rank = static_cast<int>(engine.rank());
    setup.world_size = static_cast<int>(engine.world_size());
    setup.step = step;
    // Unique in the job's store across checkpoints and restarted processes: the temporary
    // directory's name carries its owner's identity.
    setup.mailbox_key = concat("trainloop/checkpoint/", temporary.directory.filename().string(), "/", ++serial_);
    try {
      write_ = std::make_unique<BackgroundCheckpointWrite>(std::move(setup), capture_, checkpoint_mailbox(engine));
    } catch (...) {  // no thread on this rank: none may be in flight anywhere (the per-step agreement)
      failure = checkpoint_failure(path);
    }
    if (engine.any_rank(failure != nullptr)) {
      write_.reset();  // stops this rank's writer; rank 0's directory goes with `temporary`
      if (failure) std::rethrow_exception(failure);
      throw CheckpointError(concat("trainloop: another rank could not start writing its share of the checkpoint ",
                                   path.string(), " (its error names the cause); nothing was written, the previous "
                                   "checkpoints are unchanged"));
    }
    temporary.armed = false;  // the writer's now: committed or removed by its thread
    done_ = std::move(done);
    report_ = CheckpointReport{path, nullptr, true, 0.0, 0.0};
    since_start_ = Stopwatch();
    report_.blocked_seconds = clock.seconds();
  }

  /// Starts a gathered checkpoint (one file, written by the rank that `writes`: rank 0) behind
  /// training: `snapshot()` builds its archive now on that rank (checkpoint/background_gathered_write.hpp).
  /// A collective: every rank learns whether the start worked.
  /// @throws trainloop::CheckpointError on every rank when it did not (nothing is written then).
  template <ModeEngine Engine>
  void start_gathered(Engine& engine, const std::function<torch::serialize::OutputArchive()>& snapshot,
                      const std::filesystem::path& path, int64_t step, bool writes,
                      std::function<void(const CheckpointReport&)> done) {
    make_room(engine);
    Stopwatch clock;
    std::exception_ptr failure;
    try {
      write_ = std::make_unique<BackgroundGatheredWrite>(writes ? snapshot() : torch::serialize::OutputArchive(),
                                                         gathered_capture_, path, step, writes);
    } catch (...) {
      failure = checkpoint_failure(path);
    }
    if (engine.any_rank(failure != nullptr)) {
      write_.reset();
      if (failure) std::rethrow_exception(failure);
      throw CheckpointError(concat("trainloop: another rank could not start writing the checkpoint ", path.string(),
                                   " (its error names the cause); nothing was written, the previous checkpoints are "
                                   "unchanged"));
    }
    done_ = std::move(done);
    report_ = CheckpointReport{path, nullptr, true, 0.0, 0.0};
    since_start_ = Stopwatch();
    report_.blocked_seconds = clock.seconds();
  }

  /// Before another checkpoint: the one in flight must end first (back pressure: its buffers are
  /// reused, and checkpoints commit in order), said once. A collective while one is in flight.
  template <ModeEngine Engine>
  void make_room(Engine& engine) {
    if (!write_) return;
    if (engine.is_main() && !said_back_pressure_) {
      std::cerr << "trainloop: a checkpoint is due while " << report_.path.filename().string() << " is still being "
                << "written behind training; training waits for it (checkpoints are due faster than this machine "
                << "writes them; said once)\n";
      said_back_pressure_ = true;
    }
    drain(engine);
  }

  /// Waits until the checkpoint in flight holds its own copy of the state (before anything
  /// changes the parameters or the optimizer state in place). No collective.
  void await_capture() {
    if (!write_) return;
    Stopwatch clock;
    write_->wait_copied();
    report_.blocked_seconds += clock.seconds();
  }

  /// At a step boundary, on every rank: ends the checkpoint in flight when rank 0's writer is done
  /// (one small collective while one is in flight; none otherwise).
  template <ModeEngine Engine>
  void poll(Engine& engine) {
    if (!write_) return;
    Stopwatch clock;
    const bool over = engine.any_rank(engine.rank() == 0 && write_->finished());
    report_.blocked_seconds += clock.seconds();
    if (over) complete(engine);
  }

  /// Waits for the checkpoint in flight to end and reports it (every rank: a collective).
  template <ModeEngine Engine>
  void drain(Engine& engine) {
    if (!write_) return;
    Stopwatch clock;
    progress::PhaseScope phase(progress::Phase::CheckpointWrite, report_.path.filename().string());
    // Every rank's own writer first (rank 0's: committed; the others': posted): on CUDA a writer's
    // copy runs on the stream a collective would make wait for rank 0, which waits for that copy.
    write_->wait_finished();
    (void)engine.any_rank(engine.rank() == 0);  // the others wait here for rank 0's commit
    report_.blocked_seconds += clock.seconds();
    complete(engine);
  }

  /// Stops the checkpoint in flight without committing it and without a collective (fit() failed).
  void cancel() {
    write_.reset();
    done_ = nullptr;
  }

  /// Bytes of host memory the capture's buffers hold (one rank's part of a checkpoint).
  int64_t buffer_bytes() const { return capture_.buffer_bytes(); }

  /// The buffers a gathered checkpoint's archive holds in place of the live tensors
  /// (checkpoint/gathered_capture.hpp): planned by the caller of start_gathered(), once no
  /// checkpoint is in flight (make_room()), since the one in flight streams from them.
  GatheredCapture& gathered_capture() { return gathered_capture_; }

 private:
  /// Every rank: whether any failed (a collective), then `done` with the report.
  template <ModeEngine Engine>
  void complete(Engine& engine) {
    Stopwatch clock;
    std::exception_ptr error = write_->join();
    write_.reset();
    const bool failed = engine.any_rank(error != nullptr);
    if (failed && !error) {
      error = std::make_exception_ptr(CheckpointError(concat(
          "trainloop: another rank could not write its part of the checkpoint ", report_.path.string(),
          " (its error names the cause); nothing was committed, the previous checkpoints are unchanged")));
    }
    CheckpointReport report = report_;
    report.error = error;
    report.blocked_seconds += clock.seconds();
    report.seconds = since_start_.seconds();
    std::function<void(const CheckpointReport&)> done = std::move(done_);
    done_ = nullptr;
    if (done) done(report);
  }

  ShareCapture capture_;  // before write_: the writer's thread reads it until it ends
  GatheredCapture gathered_capture_;  // the same, for a gathered checkpoint
  std::unique_ptr<BackgroundWrite> write_;  // BackgroundCheckpointWrite or BackgroundGatheredWrite
  std::function<void(const CheckpointReport&)> done_;
  CheckpointReport report_;
  Stopwatch since_start_;
  int64_t serial_ = 0;
  bool said_back_pressure_ = false;
};

}  // namespace trainloop::detail
