#pragma once
/// @file
/// @brief The event interface of the training loop: every hook, and the context each one sees.
///
/// Every hook, in the order the loop calls it:
///
/// | hook                       | when                                                                    |
/// |----------------------------|-------------------------------------------------------------------------|
/// | on_fit_begin               | once, after the mode is prepared (and a checkpoint resumed), before the first epoch |
/// | on_epoch_begin             | before the first batch of each epoch (also a resumed, partly done one)   |
/// | on_train_batch             | before each training micro-batch's forward, with its input and target (Example batches): may replace them (MixUp) |
/// | on_batch_end               | after each training micro-batch's forward and backward                  |
/// | on_before_optimizer_step   | after the gradients are reduced across replicas/ranks and clipped, before the optimizer step |
/// | on_step_end                | after each optimizer step (once per accumulation window)                |
/// | on_straggler               | main process only, at the step boundary after the straggler watch named a slow rank (or its end) |
/// | on_validation_end          | after the validation pass of an epoch                                   |
/// | on_epoch_end               | after the epoch, with its complete record                               |
/// | on_fit_end                 | once, after the last epoch (also after an early stop)                   |
/// | on_fit_finally             | once, always, last: also when training threw (with the exception)      |
/// | save_state / load_state    | the callback's own state, written into every checkpoint and restored on resume |
///
/// Every hook is optional (empty by default). Hooks run on every rank, so a callback may take part
/// in collectives (TrainState::any_rank); a callback whose hooks have side effects outside the
/// process (printing, files) overrides main_process_only() to return true and is then called on
/// the main process only — it never checks a rank itself.
///
/// Stopping: a callback calls TrainState::request_stop(); after every optimizer step the loop makes
/// every rank agree (one small collective) and stops after that step, so no rank is left waiting.
///
/// State: a callback with state worth keeping (a best value, a counter, a learning-rate schedule's
/// position) overrides save_state() and load_state(). Its state then travels in checkpoints and,
/// with DistributedDataParallel in spawn mode, between your process and the ranks: the callback
/// objects you pass to fit() hold rank 0's state when fit() returns.

#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/history.hpp>

#include <torch/torch.h>

#include <concepts>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief A copy of the model's weights as this rank holds them (TrainState::copy_own_weights).
struct OwnWeights {
  /// Whole: the parameters, then the buffers (registration order). Shares: this rank's chunk of
  /// each sharding unit, then the buffers (whole on every rank).
  std::vector<torch::Tensor> tensors;
  /// True for shares: only this rank, in this fit (same layout and world size), can put them back.
  bool shares = false;
};

/// @brief TrainState::whole_weights()'s scope: frees the whole weights when it ends.
class WholeWeightsScope {
 public:
  /// @param free what frees them (TrainState::free_whole_weights; may be empty)
  explicit WholeWeightsScope(std::function<void()> free) : free_(std::move(free)) {}
  /// Takes over `other`'s duty to free them.
  WholeWeightsScope(WholeWeightsScope&& other) noexcept : free_(std::exchange(other.free_, {})) {}
  WholeWeightsScope(const WholeWeightsScope&) = delete;
  WholeWeightsScope& operator=(const WholeWeightsScope&) = delete;
  WholeWeightsScope& operator=(WholeWeightsScope&&) = delete;
  /// Frees the whole weights (an error doing so is left to the next batch, which frees them too).
  ~WholeWeightsScope() {
    if (!free_) return;
    try {
      free_();
    } catch (...) {  // the next batch frees them anyway (a destructor must not throw)
    }
  }

 private:
  std::function<void()> free_;
};

/// @brief How a checkpoint started by TrainState::start_checkpoint ended, and what it cost.
struct CheckpointReport {
  std::filesystem::path path;  ///< the checkpoint
  std::exception_ptr error;    ///< why it was not written (every rank has one then); null: it is committed
  bool background = false;     ///< written behind training (per-rank, or gathered and large), not while training waited
  /// Seconds the training thread waited because of it: the capture at its step, the next
  /// optimizer step's wait for the copy, a later checkpoint's wait for this one, the agreement.
  double blocked_seconds = 0.0;
  double seconds = 0.0;        ///< from its start to the step boundary where the ranks agreed it ended
};

/// @brief What every hook sees: where training stands, the model and optimizer, this process's
/// place in the job, and the loop's services (stop, agree, checkpoint).
struct TrainState {
  // ---- progress -------------------------------------------------------------------------
  int64_t epoch = 0;              ///< current epoch, 1-based, counted over the loop's life (a second fit() continues); in on_fit_begin the first one about to run
  int64_t first_epoch = 1;        ///< the first epoch of this fit()
  int64_t planned_epochs = 0;     ///< the epoch this fit() ends with (when fitting by iterations: the epoch of its last step)
  int64_t batch = 0;              ///< micro-batches done in this epoch on this process (a resumed epoch counts the earlier ones)
  int64_t batches_per_epoch = 0;  ///< micro-batches per epoch on this process
  int64_t step = 0;               ///< optimizer steps done in this fit()
  int64_t global_step = 0;        ///< optimizer steps over the loop's life (checkpoints resumed included)
  int64_t planned_steps = 0;      ///< optimizer steps this fit() takes in all
  int64_t epoch_samples = 0;      ///< training samples processed in this epoch (this process x world size)
  double epoch_seconds = 0.0;     ///< seconds since the epoch began
  double fit_seconds = 0.0;       ///< seconds since fit() began
  const History* history = nullptr;  ///< records of the epochs finished so far (all fits)

  // ---- the job ----------------------------------------------------------------------------
  int64_t rank = 0;        ///< this process's rank (0 without DDP)
  int64_t world_size = 1;  ///< number of ranks (1 for single device and DataParallel)
  bool is_main = true;     ///< true on the process that prints and writes files

  // ---- the model ----------------------------------------------------------------------------
  torch::nn::Module* model = nullptr;          ///< the model being trained (the unwrapped module)
  torch::optim::Optimizer* optimizer = nullptr;  ///< its optimizer
  /// Classes of the training data when its dataset says (an ImageFolder's classes, a
  /// TensorDataset's num_classes, FashionMNIST's 10); 0 when it does not.
  int64_t num_classes = 0;

  /// Mean training loss of this epoch so far on this process. Synchronises with the device:
  /// call it at display rate, not every batch.
  std::function<double()> running_loss;
  /// Loss of the last micro-batch (this process's). Computed when called: a device
  /// synchronisation then, none when unused.
  std::function<double()> last_loss;

  /// @brief The optimizer's learning rate per param group, now.
  std::vector<double> learning_rates() const {
    std::vector<double> rates;
    if (optimizer == nullptr) return rates;
    for (const auto& group : optimizer->param_groups()) rates.push_back(group.options().get_lr());
    return rates;
  }

  // ---- services -------------------------------------------------------------------------------
  /// @brief Asks the loop to stop after the current optimizer step; every rank agrees first.
  void request_stop(std::string reason) {
    stop_requested = true;
    stop_reason = std::move(reason);
  }
  bool stop_requested = false;  ///< set by request_stop()
  std::string stop_reason;      ///< the reason given to request_stop()

  /// True on every rank if `flag` is true on any. A collective: every rank must call it at the
  /// same point (from a hook that runs on every rank).
  std::function<bool(bool)> any_rank;
  /// The mean of `value` over every rank (the value itself with one process). A collective, like any_rank.
  std::function<double(double)> mean_over_ranks;
  /// Optimizer steps skipped so far because fp16 gradients overflowed (every rank skips the same).
  int64_t skipped_steps = 0;
  // ---- the weights under sharding ------------------------------------------------------------
  // gpu_mode::FullyShardedDataParallel at sharding full keeps only this rank's chunk of each
  // unit during a fit: between the operators that use them, `model`'s parameters keep their sizes
  // but have no memory, so a hook that reads them (on_epoch_end, on_fit_end...) asks first. In
  // every other mode the model is whole and these cost nothing.
  /// Makes every parameter of `model` whole on this rank until free_whole_weights(), or the next
  /// training batch or evaluation. A collective, like any_rank: every rank calls it at the same
  /// point, so from a callback that runs on every rank (main_process_only() false; a main-process
  /// callback that needs the weights gets them from one that does).
  std::function<void()> gather_whole_weights;
  /// Frees what gather_whole_weights() gathered; what a hook changed in the whole weights stays
  /// (every rank must change them alike). No collective.
  std::function<void()> free_whole_weights;
  /// @brief gather_whole_weights() now, free_whole_weights() when the returned scope ends: call
  /// it on every rank (see gather_whole_weights).
  [[nodiscard]] WholeWeightsScope whole_weights() {
    if (gather_whole_weights) gather_whole_weights();
    return WholeWeightsScope(free_whole_weights);
  }
  /// A copy of the weights as this rank holds them, without a gather: whole, or under sharding
  /// full this rank's shares (EarlyStopping's best weights: 1/W of the model per rank). No collective.
  std::function<OwnWeights()> copy_own_weights;
  /// Puts a copy_own_weights() of this fit back (every rank its own, of the same moment: the model
  /// is then that moment's on every rank). No collective.
  std::function<void(const OwnWeights&)> restore_own_weights;

  /// Writes a checkpoint of everything needed to resume exactly (model, optimizer, callbacks'
  /// states, progress, random number generators of every rank) to `path`: rank 0 writes it
  /// atomically, every rank learns whether it worked. A collective, like any_rank.
  /// @throws trainloop::Error on every rank when it could not be written (disk full, unwritable
  ///         directory), naming the path.
  std::function<void(const std::filesystem::path&)> save_checkpoint;
  /// Starts a checkpoint of this moment, as save_checkpoint writes it, and returns. Where the
  /// mode writes per-rank checkpoints (sharded modes), the state is copied into host buffers while
  /// the next step's forward and backward run and written by a thread per rank; `done` runs on
  /// every rank at the step boundary where the ranks agree it is committed or failed (then, or at
  /// the end of fit(), which waits for it). A checkpoint started while the previous one is still
  /// being written waits for that one first (its `done` runs first); one started in on_fit_end
  /// is waited for after it, one started in on_fit_finally is dropped. Where the mode writes one
  /// file (rank 0), a state of 16 MiB or more is streamed into it by a thread of rank 0's (the next
  /// optimizer step waits for the stream), a smaller one is written now and `done` runs before
  /// this returns. A collective, like any_rank. `done` may throw (as a hook does); errors of the
  /// write arrive in its report.
  std::function<void(const std::filesystem::path&, std::function<void(const CheckpointReport&)>)> start_checkpoint;
  /// Waits for a checkpoint start_checkpoint left being written and runs its `done` (before
  /// planning the next one; said once on the main process: checkpoints are then due faster than
  /// they are written). A collective, like any_rank; nothing when none is in flight.
  std::function<void()> wait_for_checkpoints;
};

/// @brief Base class of callbacks; override the hooks you need (see the table in callback.hpp).
class Callback : public Stateful {
 public:
  virtual ~Callback() = default;
  /// @brief True for callbacks with side effects outside the process (printing, files): the loop
  /// then calls them on the main process only.
  virtual bool main_process_only() const { return false; }
  /// @brief True for callbacks that save the other callbacks' state (ModelCheckpoint): the loop
  /// calls them after every other callback in each hook, so a checkpoint written at an epoch's
  /// end holds what the others made of that epoch (an early stop's counter, a lowered lr).
  virtual bool runs_after_others() const { return false; }
  /// @brief Once, before the first epoch.
  virtual void on_fit_begin(TrainState&) {}
  /// @brief Before each epoch's first batch.
  virtual void on_epoch_begin(TrainState&) {}
  /// @brief Before each training micro-batch's forward, for batches of torch::data::Example<>:
  /// may replace the input and the target (MixUp mixes samples and turns labels into soft
  /// targets). Runs on every rank that has samples in the micro-batch, on its whole micro-batch
  /// (before DataParallel splits it); with exact uneven batches a DDP rank can have none in an
  /// epoch's last micro-batch (TrainLoopOptions::exact_uneven_batches), so take part in no
  /// collective here.
  virtual void on_train_batch(TrainState&, torch::Tensor& /*input*/, torch::Tensor& /*target*/) {}
  /// @brief True for callbacks that work through on_train_batch (MixUp): it runs for batches of
  /// torch::data::Example<> only, so fit() with another batch type refuses such a callback at its
  /// start instead of training without it.
  virtual bool needs_example_batches() const { return false; }
  /// @brief After each training micro-batch (forward and backward done).
  virtual void on_batch_end(TrainState&) {}
  /// @brief After the gradients are reduced (and clipped), just before the optimizer step: the
  /// place to inspect or change gradients, or the learning rate of this step.
  virtual void on_before_optimizer_step(TrainState&) {}
  /// @brief After each optimizer step.
  virtual void on_step_end(TrainState&) {}
  /// @brief A rank slowed every other (or no longer does): the straggler watch's record
  /// (DDP and fsdp; also in History::stragglers). On the main process only (rank 0, whose
  /// watchdog compares the ranks), at the first step boundary after it was logged, before
  /// on_step_end: take part in no collective here.
  virtual void on_straggler(TrainState&, const StragglerRecord&) {}
  /// @brief After the validation pass of an epoch.
  virtual void on_validation_end(TrainState&, const EvalResult&) {}
  /// @brief After each epoch, with its record.
  virtual void on_epoch_end(TrainState&, const EpochRecord&) {}
  /// @brief Once, after the last epoch.
  virtual void on_fit_end(TrainState&, const History&) {}
  /// @brief Once, always, after everything else: `error` holds the exception training threw
  /// (it is rethrown after every callback's on_fit_finally ran), or is null.
  virtual void on_fit_finally(TrainState&, const std::exception_ptr& /*error*/) {}

  // State (save_state, load_state, state_key, state_optional) comes from Stateful
  // (checkpoint/stateful.hpp): override save_state()/load_state() to keep state across resumes.
};

/// @brief One callback given to fit(): by value (`FlatCos(1e-3)`, copied into the list) or as a
/// shared_ptr (keep it to read the callback after fit(), e.g. a ModelCheckpoint's best()).
class CallbackArg {
 public:
  /// @brief A callback you keep a handle to.
  template <std::derived_from<Callback> T>
  CallbackArg(std::shared_ptr<T> callback) : callback_(std::move(callback)) {}  // NOLINT: implicit on purpose
  /// @brief A callback by value: the list holds its own copy.
  template <class T>
    requires std::derived_from<std::remove_cvref_t<T>, Callback>
  CallbackArg(T&& callback)  // NOLINT: implicit on purpose
      : callback_(std::make_shared<std::remove_cvref_t<T>>(std::forward<T>(callback))) {}
  /// @brief The callback.
  const std::shared_ptr<Callback>& get() const { return callback_; }

 private:
  std::shared_ptr<Callback> callback_;
};

/// @brief The callbacks given to one fit() call: `loop.fit(2, {FlatCos(1e-3), MixUp(0.1), checkpoint})`,
/// callbacks by value and shared_ptrs mixed.
class CallbackList : public std::vector<std::shared_ptr<Callback>> {
 public:
  CallbackList() = default;
  /// @brief From callbacks by value or shared_ptrs, in the order the hooks run.
  CallbackList(std::initializer_list<CallbackArg> callbacks) {
    reserve(callbacks.size());
    for (const auto& callback : callbacks) push_back(callback.get());
  }
  /// @brief From a vector of shared_ptrs.
  CallbackList(std::vector<std::shared_ptr<Callback>> callbacks)  // NOLINT: implicit on purpose
      : std::vector<std::shared_ptr<Callback>>(std::move(callbacks)) {}
};

namespace detail {

/// Keys for `callbacks`' states: state_key(), with "#2", "#3"... for repeats, in order.
inline KeyedStates keyed_callbacks(const CallbackList& callbacks) {
  KeyedStates keyed;
  std::map<std::string, int> seen;
  for (const auto& callback : callbacks) {
    std::string key = callback->state_key();
    const int count = ++seen[key];
    if (count > 1) {
      key += '#';  // not `"#" + std::to_string(count)`: GCC 12 -O2 warns falsely (-Wstringop-overflow)
      key += std::to_string(count);
    }
    keyed.emplace_back(std::move(key), callback.get());
  }
  return keyed;
}

}  // namespace detail

}  // namespace trainloop
