#pragma once
/// @file
/// @brief Where a TrainLoop stands between and inside fit() calls: what the next fit() continues
/// from, and what a checkpoint records so a resumed run continues exactly.

#include <trainloop/history.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <optional>

namespace trainloop::detail {

/// The loop's position in training, over its whole life (all fit() calls, resumed checkpoints).
struct TrainingProgress {
  History history;                 ///< records of the completed epochs; total_steps = global steps
  int64_t epochs_completed = 0;    ///< epochs fully trained
  int64_t global_step = 0;         ///< optimizer steps taken
  /// Inside epoch epochs_completed + 1: positions of its sample order already trained (over all
  /// ranks), the micro-batches each rank ran, and the steps taken; 0 at an epoch boundary.
  uint64_t samples_into_epoch = 0;
  int64_t batches_into_epoch = 0;  ///< micro-batches of the partial epoch on each rank
  int64_t steps_into_epoch = 0;    ///< optimizer steps of the partial epoch
  double seconds_into_epoch = 0.0;   ///< training seconds of the partial epoch so far
  double data_wait_into_epoch = 0.0;  ///< of those, seconds spent waiting for the loader
  /// Metric sums of the partial epoch, one row per rank that trained it ([ranks, width] float64,
  /// CPU), so the epoch's record equals an uninterrupted run's. Undefined at a boundary.
  torch::Tensor partial_totals;
  std::optional<EpochRecord> partial_record;  ///< what the partial epoch measured so far (for History)
  uint64_t sampler_seed = 0;       ///< the seed of the epoch orders (kept from the first fit())
  bool seeded = false;             ///< torch's generator was seeded by the first fit()
  torch::Tensor grad_scaler_state; ///< the fp16 loss scaler's GradScaler::state(); undefined before fp16 training

  /// The fit() call that was running: a checkpoint taken inside it resumes it to its end.
  int64_t fit_first_epoch = 1;     ///< its first epoch
  int64_t fit_first_step = 0;      ///< global step when it began
  int64_t fit_epoch_count = 0;     ///< epochs it was asked for (0 when fitting by iterations)
  int64_t fit_step_count = 0;      ///< steps it was asked for (0 when fitting by epochs)
  bool fit_finished = true;        ///< it ran to its end (a checkpoint after that starts a new call)

  /// True while inside an epoch (a fit by iterations stopped there, or a mid-epoch checkpoint).
  bool mid_epoch() const { return samples_into_epoch > 0 || batches_into_epoch > 0; }

  /// The History as a user sees it: the completed epochs, then the partial one, if any.
  History visible_history() const {
    History visible = history;
    if (partial_record) visible.epochs.push_back(*partial_record);
    visible.total_steps = global_step;
    return visible;
  }
};

}  // namespace trainloop::detail
