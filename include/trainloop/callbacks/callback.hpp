#pragma once
/// @file
/// @brief The event interface of the training loop.
///
/// Every hook, in the order the loop calls it:
///
/// | hook                  | when                                                        | state fields valid                          |
/// |-----------------------|-------------------------------------------------------------|---------------------------------------------|
/// | on_fit_begin          | once, after the mode is prepared, before the first epoch    | planned_epochs, planned_steps, batches_per_epoch |
/// | on_epoch_begin        | before the first batch of each epoch                        | + epoch                                     |
/// | on_batch_end          | after each training micro-batch's forward and backward      | + batch, step, epoch_samples, running_loss() |
/// | on_step_end           | after each optimizer step (once per accumulation window)    | + step                                      |
/// | on_validation_end     | after the validation pass of an epoch                       | + the EvalResult                            |
/// | on_epoch_end          | after the epoch, with its complete record                   | + the EpochRecord                           |
/// | on_fit_end            | once, after the last epoch (also after an early stop)       | history                                     |
///
/// Every hook is optional (empty by default). Hooks run on every rank, so a callback may use
/// collectives through the loop's mode; a callback whose hooks have side effects outside the
/// process (printing, files) overrides main_process_only() to return true and is then called on
/// the main process only — it never checks a rank itself.
/// A callback asks training to stop with TrainState::request_stop(); the loop makes every rank
/// agree at the end of the epoch (or step) before stopping, so no rank is left waiting.

#include <trainloop/history.hpp>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace trainloop {

/// @brief The loop's progress, as callbacks see it.
struct TrainState {
  int64_t epoch = 0;              ///< current epoch, 1-based
  int64_t planned_epochs = 0;     ///< epochs fit() will run (ceil of steps / batches when fitting by iterations)
  int64_t batch = 0;              ///< micro-batches done in this epoch
  int64_t batches_per_epoch = 0;  ///< micro-batches per epoch on this process
  int64_t step = 0;               ///< optimizer steps done in this fit()
  int64_t planned_steps = 0;      ///< optimizer steps fit() will take in all
  int64_t epoch_samples = 0;      ///< training samples processed in this epoch (this process x world size)
  int64_t world_size = 1;         ///< number of ranks (1 for single device and DataParallel)
  double epoch_seconds = 0.0;     ///< seconds since the epoch began
  double fit_seconds = 0.0;       ///< seconds since fit() began
  const History* history = nullptr;  ///< records of the epochs finished so far
  /// Mean training loss of this epoch so far on this process. Synchronises with the device:
  /// call it at display rate, not every batch.
  std::function<double()> running_loss;

  /// @brief Asks the loop to stop after the current epoch; every rank agrees first.
  void request_stop(std::string reason) {
    stop_requested = true;
    stop_reason = std::move(reason);
  }
  bool stop_requested = false;  ///< set by request_stop()
  std::string stop_reason;      ///< the reason given to request_stop()
};

/// @brief Base class of callbacks; override the hooks you need (see the table in callback.hpp).
class Callback {
 public:
  virtual ~Callback() = default;
  /// @brief True for callbacks with side effects outside the process (printing, files): the loop
  /// then calls them on the main process only.
  virtual bool main_process_only() const { return false; }
  /// @brief Once, before the first epoch.
  virtual void on_fit_begin(TrainState&) {}
  /// @brief Before each epoch's first batch.
  virtual void on_epoch_begin(TrainState&) {}
  /// @brief After each training micro-batch (forward and backward done).
  virtual void on_batch_end(TrainState&) {}
  /// @brief After each optimizer step.
  virtual void on_step_end(TrainState&) {}
  /// @brief After the validation pass of an epoch.
  virtual void on_validation_end(TrainState&, const EvalResult&) {}
  /// @brief After each epoch, with its record.
  virtual void on_epoch_end(TrainState&, const EpochRecord&) {}
  /// @brief Once, after the last epoch.
  virtual void on_fit_end(TrainState&, const History&) {}
};

/// @brief The callbacks given to one fit() call.
using CallbackList = std::vector<std::shared_ptr<Callback>>;

}  // namespace trainloop
