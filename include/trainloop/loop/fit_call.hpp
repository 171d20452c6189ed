#pragma once
/// @file
/// @brief Which fit() call the loop's progress records (checkpoint/training_progress.hpp): a call
/// starts where the last one stopped, a resumed checkpoint of an unfinished call continues that
/// call, and the call's length says where it ends — so a second fit() goes on with the next
/// epoch, and a resumed one ends where the interrupted one would have.

#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/options.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <limits>

namespace trainloop::detail {

/// Whether the fit() call `progress` records ran to its end: it said so, or it reached the
/// length it was asked for (a checkpoint written in its last epoch's on_epoch_end).
inline bool fit_call_finished(const TrainingProgress& progress) {
  if (progress.fit_finished) return true;
  if (progress.fit_epoch_count > 0) {
    return progress.epochs_completed >= progress.fit_first_epoch - 1 + progress.fit_epoch_count;
  }
  return progress.fit_step_count > 0 && progress.global_step >= progress.fit_first_step + progress.fit_step_count;
}

/// Records in `progress` which fit() call runs, of `length`: a new one unless a checkpoint of an
/// unfinished call was `resumed`. Seeds the random streams with `seed` on the loop's first fit;
/// later ones continue them.
inline void start_fit_call(TrainingProgress& progress, uint64_t seed, bool resumed, const FitLength& length) {
  if (!progress.seeded) {  // the first fit of this loop; later ones continue the random stream
    torch::manual_seed(seed);
    progress.sampler_seed = seed;
    progress.seeded = true;
  }
  if (!resumed || fit_call_finished(progress)) {  // a new fit() call
    progress.fit_first_epoch = progress.epochs_completed + 1;
    progress.fit_first_step = progress.global_step;
    progress.fit_finished = false;
  }
  progress.fit_epoch_count = length.epoch_count();
  progress.fit_step_count = length.iteration_count();
  progress.history.stop_reason.clear();
}

/// Where a fit() call ends, and what it plans (what TrainState shows callbacks).
struct FitCallBounds {
  int64_t end_step = 0;        ///< the global step at which the call ends (max without a step count)
  int64_t end_epoch = 0;       ///< the epoch after which the call ends (max when fitting by steps)
  int64_t planned_epochs = 0;  ///< the epoch it ends with (fitting by steps: the epoch of its last step)
  int64_t planned_steps = 0;   ///< the optimizer steps it takes in all
};

/// The bounds of the fit() call `progress` records, of `length`, with `batches_per_epoch`
/// micro-batches in an epoch and `accumulation` of them to a step.
inline FitCallBounds fit_call_bounds(const TrainingProgress& progress, const FitLength& length, int64_t batches_per_epoch,
                                     int64_t accumulation) {
  const int64_t steps_per_epoch = (batches_per_epoch + accumulation - 1) / accumulation;
  constexpr int64_t unbounded = std::numeric_limits<int64_t>::max();
  FitCallBounds bounds;
  bounds.end_step = length.iteration_count() > 0 ? progress.fit_first_step + length.iteration_count() : unbounded;
  // Fitting by iterations, only the step count ends the call; the epoch shown is an estimate.
  bounds.end_epoch = length.epoch_count() > 0 ? progress.fit_first_epoch - 1 + length.epoch_count() : unbounded;
  bounds.planned_epochs = length.epoch_count() > 0
                              ? bounds.end_epoch
                              : progress.fit_first_epoch - 1 + (length.iteration_count() + steps_per_epoch - 1) / steps_per_epoch;
  bounds.planned_steps = length.iteration_count() > 0 ? length.iteration_count()
                                                       : (bounds.end_epoch - progress.fit_first_epoch + 1) * steps_per_epoch;
  return bounds;
}

}  // namespace trainloop::detail
