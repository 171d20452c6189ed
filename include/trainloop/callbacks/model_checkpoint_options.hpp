#pragma once
/// @file
/// @brief ModelCheckpointOptions: where and how often ModelCheckpoint writes, and what it keeps.

#include <trainloop/callbacks/monitor.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>

namespace trainloop {

/// @brief Options of ModelCheckpoint; only the directory is required.
struct ModelCheckpointOptions {
  /// @param directory where the checkpoints go (created if missing)
  explicit ModelCheckpointOptions(std::filesystem::path directory) : directory_(std::move(directory)) {}
  /// Directory of the checkpoints.
  TORCH_ARG(std::filesystem::path, directory);
  /// Write one at the end of every N-th epoch; 0: not by epoch.
  TORCH_ARG(int64_t, every_n_epochs) = 1;
  /// Write one after every N-th optimizer step (inside epochs too); 0: not by step.
  TORCH_ARG(int64_t, every_n_steps) = 0;
  /// Write one when this many minutes passed since the last one (checked after every step); 0: not by time.
  TORCH_ARG(double, every_minutes) = 0.0;
  /// Periodic checkpoints kept (the newest); 0 keeps all.
  TORCH_ARG(int64_t, keep_last) = 1;
  /// The value that ranks checkpoints for keep_best: "val_loss", "val_<metric>", "train_loss",
  /// "train_<metric>" (e.g. "val_accuracy"). Empty: no best checkpoints.
  TORCH_ARG(std::string, monitor) = "";
  /// Whether smaller or larger values of `monitor` are better.
  TORCH_ARG(MonitorMode, mode) = MonitorMode::Min;
  /// Best checkpoints kept (by `monitor`, checked at the end of every epoch); 0: none.
  TORCH_ARG(int64_t, keep_best) = 1;
  /// A checkpoint that cannot be written stops training (true) or is reported and skipped (false).
  TORCH_ARG(bool, stop_on_error) = true;
  /// Per-rank checkpoints (the sharded modes) are written behind training (true): the state is
  /// copied into host buffers while the next step's forward and backward run and written by a
  /// thread per rank; an error is reported at the step boundary where the ranks agree the write
  /// ended (TrainState::start_checkpoint). false: training waits for every checkpoint, as a
  /// callback needs that changes the parameters in place outside the optimizer step between a
  /// checkpoint and the next step. One file written by rank 0 (the other modes) is always
  /// written while training waits.
  TORCH_ARG(bool, in_background) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::ConfigurationError naming the first option out of range.
  void validate() const {
    TRAINLOOP_CHECK(!directory_.empty(), "the checkpoint directory is empty; expected a path");
    TRAINLOOP_CHECK(every_n_epochs_ >= 0 && every_n_steps_ >= 0 && every_minutes_ >= 0.0,
                    "checkpoint intervals are every ", every_n_epochs_, " epochs, ", every_n_steps_, " steps, ",
                    every_minutes_, " minutes; expected 0 (off) or positive values");
    TRAINLOOP_CHECK(monitor_.find_first_of(std::string("/\0", 2)) == std::string::npos, "the monitored value is '",
                    monitor_, "'; expected a name without '/' (it becomes part of a file name)");
    TRAINLOOP_CHECK(keep_last_ >= 0 && keep_best_ >= 0, "keep_last is ", keep_last_, " and keep_best ", keep_best_,
                    "; expected 0 or more");
  }
};

}  // namespace trainloop
