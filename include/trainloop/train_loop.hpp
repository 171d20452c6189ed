#pragma once
/// @file
/// @brief TrainLoop<Model, GpuMode>: trains a libtorch model with one loop in every gpu_mode.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/lr_finder.hpp>
#include <trainloop/callbacks/progress_bar.hpp>
#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/cpu/allocator.hpp>
#include <trainloop/cpu/threads.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/data/batch_loader.hpp>
#include <trainloop/distributed/job/main_process.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/history.hpp>
#include <trainloop/loop/fit_runner.hpp>
#include <trainloop/loop/loop_snapshot.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/nn/memory_format.hpp>
#include <trainloop/options.hpp>
#include <trainloop/version.hpp>

#include <torch/torch.h>

#include <memory>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief The training loop.
///
/// @tparam Model a TORCH_MODULE holder (e.g. `Net` for `NetImpl`) or a module class (then the
///         loop takes a `std::shared_ptr<Model>`); see model_contract.hpp for what it must define.
/// @tparam GpuMode the policy: gpu_mode::Single, gpu_mode::DataParallel or
///         gpu_mode::DistributedDataParallel.
/// @tparam Batch what the datasets yield per batch; `torch::data::Example<>` (input, target) by default.
///
/// @code
/// trainloop::TrainLoop<Net> loop(net, train_set, test_set, optimizer,
///                                torch::nn::CrossEntropyLoss(),
///                                trainloop::TrainLoopOptions().batch_size(128));
/// trainloop::History history = loop.fit(5);
/// @endcode
///
/// The template arguments may be left to the compiler (the deduction guides below the class):
/// Model from the model (a TORCH_MODULE holder, or `std::shared_ptr<Impl>` for `Impl`), GpuMode
/// from the mode argument (gpu_mode::Single without one), Batch from the training dataset:
///
/// @code
/// trainloop::TrainLoop loop(net, train_set, test_set, optimizer, torch::nn::CrossEntropyLoss(),
///                           trainloop::TrainLoopOptions(), trainloop::gpu_mode::parse("ddp"));
/// @endcode
///
/// The caller's model holds the trained weights after fit(), in every mode.
template <class Model, class GpuMode = gpu_mode::Single, class Batch = torch::data::Example<>>
class TrainLoop {
 public:
  /// The module class trained (the holder's contained type, or Model itself).
  using module_type = detail::module_t<Model>;
  /// The model as the loop stores it: the holder, or a shared_ptr to the module.
  using model_handle = typename detail::ModelHandle<Model>::stored_type;
  /// The engine that implements GpuMode for this model.
  using engine_type = typename GpuMode::template engine<module_type>;
  static_assert(ModeEngine<engine_type> || detail::is_any_engine_v<engine_type>,
                "trainloop: GpuMode's engine does not implement the mode interface (engine/mode_engine.hpp: "
                "is_main, rank, world_size, device, data_shard, all_reduce_sum, all_gather, any_rank, barrier, "
                "prepare, begin_fit, end_fit, before_optimizer_step, after_optimizer_step), and it is not a "
                "run-time choice of modes (gpu_mode::AnyOf)");
  static_assert(!ModeEngine<engine_type> || !detail::engine_supports_v<engine_type, Batch> ||
                    ModeEngineFor<engine_type, Batch>,
                "trainloop: GpuMode's engine cannot train or evaluate this Batch type: it needs "
                "train_micro_batch(batch, forward, loss_scale, synchronize, sink) and eval_batch(batch, forward, "
                "sink) (engine/mode_engine.hpp)");

  /// @brief Builds the loop; nothing is moved or spawned until fit() or evaluate().
  /// @param model the model; it keeps the trained weights after fit()
  /// @param train the training dataset (any sized libtorch dataset; copies share it)
  /// @param validation evaluated after every epoch; `{}` for none
  /// @param optimizer built over `model`'s parameters; must outlive the loop
  /// @param criterion (output, target) -> mean loss, e.g. `torch::nn::CrossEntropyLoss()`
  /// @param options batch size, workers, seed, metrics, ...
  /// @param mode the gpu_mode policy object (devices, ranks, backend, ...)
  TrainLoop(model_handle model, data::AnyDataset<Batch> train, data::AnyDataset<Batch> validation,
            torch::optim::Optimizer& optimizer, Criterion criterion, TrainLoopOptions options = {},
            GpuMode mode = {})
      : handle_(std::move(model)),
        train_(std::move(train)),
        validation_(std::move(validation)),
        optimizer_(optimizer),
        criterion_(std::move(criterion)),
        options_(std::move(options)),
        mode_(std::move(mode)) {
    options_.validate();
    TRAINLOOP_CHECK(static_cast<bool>(criterion_), "no criterion was given");
  }

  /// @brief Builds the loop for a model that computes its own loss (model_contract.hpp's custom
  /// contract: `batch_loss(batch)` or `batch_loss(batch, criterion)`, and `batch_predictions`), so
  /// no criterion is needed. A model with only `forward()` does not compile here: it needs one.
  ///
  /// @code
  /// trainloop::TrainLoop<Siamese, trainloop::gpu_mode::Single, PairBatch> loop(net, train, test, optimizer);
  /// @endcode
  ///
  /// The other parameters are those of the constructor with a criterion. Should the model's
  /// `batch_loss(batch, criterion)` call the criterion anyway, that call throws a ConfigurationError.
  TrainLoop(model_handle model, data::AnyDataset<Batch> train, data::AnyDataset<Batch> validation,
            torch::optim::Optimizer& optimizer, TrainLoopOptions options = {}, GpuMode mode = {})
      : TrainLoop(std::move(model), std::move(train), std::move(validation), optimizer, detail::missing_criterion(),
                  std::move(options), std::move(mode)) {
    // Here, not as a constraint on the constructor: a failed constraint reads "no matching
    // constructor", where this says what the model lacks.
    detail::require_own_loss<module_type, Batch>();
  }

  /// @brief Trains for `epochs` more epochs; see the FitLength overload for `callbacks` and `resume`.
  History fit(int64_t epochs, const CallbackList& callbacks = {}, const std::string& resume = "") {
    return fit(FitLength::epochs(epochs), callbacks, resume);
  }

  /// @brief Trains for a number of epochs or an exact number of optimizer steps, from where the
  /// loop stands: a second fit() continues the epoch count, the sample order and the random
  /// stream (epoch 3 after two epochs; inside an epoch if the last fit stopped there).
  /// @param length how many more epochs or optimizer steps
  /// @param given the callbacks of this call (see callbacks/callback.hpp); a ProgressBar is added
  ///        on a terminal unless TrainLoopOptions::progress says otherwise
  /// @param resume "" to continue from the loop as it is; "last" to resume from the newest
  ///        checkpoint of the ModelCheckpoint among `callbacks` (trying older ones when it is
  ///        unreadable, starting fresh when there is none yet); a checkpoint file or directory.
  ///        A checkpoint written inside a fit() call that did not finish continues that call to
  ///        its end (so rerunning a killed program finishes its fit); one written after its end
  ///        starts a new call of `length`. After a restart (max_restarts, torchrun) "last" is
  ///        implied when a ModelCheckpoint is given. The overloads that take a Resume say the
  ///        same typed: Resume::none(), Resume::last(), Resume::from(path).
  /// @return the History of every epoch so far (earlier fits and resumed checkpoints included).
  History fit(const FitLength& length, const CallbackList& given = {}, const std::string& resume = "") {
    return fit(length, given, detail::resume_of(resume));
  }

  /// @brief Trains for `epochs` more epochs, resuming as `resume` says:
  /// `fit(10, {checkpoints}, Resume::last())`; see the FitLength overload.
  History fit(int64_t epochs, const CallbackList& callbacks, const Resume& resume) {
    return fit(FitLength::epochs(epochs), callbacks, resume);
  }

  /// @brief Trains for `length`, resuming as `resume` says: Resume::last(), Resume::from(path) and
  /// Resume::none() do exactly what the string overload's "last", path and "" do.
  History fit(const FitLength& length, const CallbackList& given, const Resume& resume) {
    const CallbackList callbacks = detail::with_default_progress(given, options_.progress());
    const detail::ResumeSpec spec = detail::resolve_resume(resume, callbacks);
    return with_prepared_engine([&](auto& mode_engine) {
      detail::FitActions actions;
      actions.train = [&](const detail::ResumeSpec& from) { return runner().fit(mode_engine, length, callbacks, from); };
      actions.save = [&](const std::filesystem::path& path, bool writes) {
        runner().save_checkpoint(mode_engine, detail::keyed_callbacks(callbacks), path, writes);
      };
      actions.save_committed = [&](const std::filesystem::path& path) {
        runner().save_committed(mode_engine, detail::keyed_callbacks(callbacks), path);
      };
      actions.save_committed_loop_state = [&](const std::filesystem::path& path) {
        runner().save_committed(mode_engine, detail::keyed_callbacks(callbacks), path, /*with_model_and_optimizer=*/false);
      };
      actions.load = [&](const std::filesystem::path& path) {
        runner().load_checkpoint(mode_engine, path, detail::keyed_callbacks(callbacks), /*restore_rng=*/true);
        return progress_.visible_history();
      };
      // A mode may wrap the loop: DDP launches ranks here, or ends a spawned rank afterwards.
      if constexpr (requires { mode_engine.run_fit(actions, spec); }) {
        return mode_engine.run_fit(actions, spec);
      } else {
        return actions.train(spec);
      }
    });
  }

  /// @brief Writes a checkpoint of the loop as it stands (model, optimizer, progress, random
  /// streams) to `path`, like ModelCheckpoint does during fit(). Under DDP every rank calls it.
  void save_checkpoint(const std::filesystem::path& path) {
    with_prepared_engine(
        [&](auto& mode_engine) { runner().save_checkpoint(mode_engine, {}, path, mode_engine.is_main()); });
  }
  /// @brief Loads a checkpoint into the loop: the next fit() continues from it.
  void load_checkpoint(const std::filesystem::path& path) {
    with_prepared_engine(
        [&](auto& mode_engine) { runner().load_checkpoint(mode_engine, path, {}, /*restore_rng=*/true); });
  }
  /// @brief The learning-rate finder (fastai's lr_find): trains num_steps optimizer steps with
  /// the learning rate growing exponentially from start_lr to end_lr, records the smoothed loss,
  /// stops when it diverges (every rank agrees), then puts the model, the optimizer, the progress
  /// and the random streams back as they were. Works in every mode; under DDP every rank gets
  /// the same result. See callbacks/lr_finder.hpp for the suggestions.
  LrFinderResult lr_find(const LrFinderOptions& options = LrFinderOptions()) {
    auto finder = std::make_shared<LrFinder>(options);
    const detail::LoopSnapshot before(handle_.module(), optimizer_, progress_);
    // The sweep neither validates (as fastai's) nor stops on a non-finite loss (divergence is what
    // it looks for): both settings come back afterwards, also on an exception.
    struct SweepSettings {
      TrainLoop& loop;
      data::AnyDataset<Batch> validation;
      bool stop_on_non_finite;
      explicit SweepSettings(TrainLoop& l)
          : loop(l), validation(std::move(l.validation_)), stop_on_non_finite(l.options_.stop_on_non_finite_loss()) {
        loop.validation_ = data::AnyDataset<Batch>();
        loop.options_.stop_on_non_finite_loss(false);
      }
      ~SweepSettings() {
        loop.validation_ = std::move(validation);
        loop.options_.stop_on_non_finite_loss(stop_on_non_finite);
      }
    } sweep_settings(*this);
    try {
      fit(FitLength::iterations(options.num_steps()), {finder});
    } catch (...) {
      before.restore(handle_.module(), optimizer_, progress_);
      throw;
    }
    before.restore(handle_.module(), optimizer_, progress_);
    return finder->result();
  }

  /// @brief Every epoch trained so far by this loop (all fits, resumed checkpoints included).
  History history() const { return progress_.visible_history(); }

  /// @brief Loss and the options' metrics over `dataset`, every sample counted once. Under DDP
  /// every rank gets the whole dataset's result (each evaluates its shard; sums are reduced),
  /// before, between and after fits.
  EvalResult evaluate(const data::AnyDataset<Batch>& dataset) {
    return with_prepared_engine([&](auto& mode_engine) { return runner().evaluate(mode_engine, dataset); });
  }

  /// @brief The model's outputs for every sample of `dataset`, in dataset order, on the CPU.
  /// Under DDP each rank predicts its shard and every rank gets all outputs.
  torch::Tensor predict(const data::AnyDataset<Batch>& dataset) {
    return with_prepared_engine([&](auto& mode_engine) { return runner().predict(mode_engine, dataset); });
  }

  /// @brief True on the process that should print and write the user's files: the same answer
  /// as trainloop::is_main_process() (the process the user started when trainloop spawns the
  /// ranks, rank 0 under torchrun, Slurm or mpirun; always true without a distributed job).
  /// Callbacks see their rank's role in TrainState::is_main instead (rank 0 writes checkpoints).
  bool is_main() {
    return is_main_process() && with_engine([](auto& mode_engine) { return mode_engine.is_main(); });
  }
  /// @brief Waits for every rank (nothing to wait for without DDP).
  void barrier() {
    with_prepared_engine([](auto& mode_engine) { mode_engine.barrier(); });
  }
  /// @brief The model (holding the trained weights after fit()).
  const model_handle& model() const { return handle_.get(); }
  /// @brief The options the loop was built with.
  const TrainLoopOptions& options() const { return options_; }
  /// @brief The optimizer the loop was built with (the caller's object, which it steps).
  torch::optim::Optimizer& optimizer() const { return optimizer_; }

 private:
  /// Calls `f` with the concrete engine: directly for a compile-time mode, through one
  /// dispatch for gpu_mode::Any.
  template <class F>
  decltype(auto) with_engine(F&& f) {
    if (!engine_) engine_.emplace(mode_, handle_.shared());
    if constexpr (ModeEngine<engine_type>) {
      return f(*engine_);
    } else {
      // Every engine returns the same type for one `f`; the single engine stands for them.
      using Result = std::invoke_result_t<F&, detail::SingleEngine<module_type>&>;
      return engine_->visit([&](auto& chosen) -> Result {
        if constexpr (detail::engine_supports_v<std::decay_t<decltype(chosen)>, Batch>) {
          static_assert(ModeEngineFor<std::decay_t<decltype(chosen)>, Batch>,
                        "trainloop: a mode of the run-time choice has an engine that cannot train or evaluate "
                        "this Batch type: it needs every member of engine/mode_engine.hpp's ModeEngineFor");
          return f(chosen);
        } else {
          throw ConfigurationError("trainloop: " + detail::engine_cannot_train_text<std::decay_t<decltype(chosen)>>());
        }
      });
    }
  }
  /// with_engine, after the engine was prepared (model placed, replicas built, process group
  /// joined): every entry point sees the model where training would put it.
  template <class F>
  decltype(auto) with_prepared_engine(F&& f) {
    return with_engine([&](auto& mode_engine) -> decltype(auto) {
      cpu::requested_threads().store(options_.num_threads());
      cpu::keep_freed_memory();  // page faults, not compute, dominated CPU epochs without it
      // Before prepare(): replicas and devices take the model's layout from it.
      auto& module = handle_.module();
      nn::to_memory_format(module, nn::uses_channels_last(options_.memory_format(), module));
      mode_engine.prepare();
      return f(mode_engine);
    });
  }
  detail::FitRunner<module_type, Batch> runner() {
    detail::RunIdentity identity;
    if constexpr (requires { mode_.name(); }) {
      identity.mode = mode_.name();
    } else {
      identity.mode = GpuMode::name;
    }
    identity.trainloop_version = TRAINLOOP_VERSION_STRING;
    return detail::FitRunner<module_type, Batch>(handle_.module(), train_, validation_, optimizer_, criterion_, options_,
                                                 progress_, identity);
  }

  detail::ModelHandle<Model> handle_;
  data::AnyDataset<Batch> train_;
  data::AnyDataset<Batch> validation_;
  torch::optim::Optimizer& optimizer_;
  Criterion criterion_;
  TrainLoopOptions options_;
  GpuMode mode_;
  std::optional<engine_type> engine_;
  detail::TrainingProgress progress_;  // where training stands, over every fit() of this loop
};

/// @brief Deduces `TrainLoop<Model, GpuMode, Batch>` from the constructor's arguments: Model from
/// the model (a TORCH_MODULE holder is the Model; a `std::shared_ptr<Impl>` makes it `Impl`),
/// GpuMode from the mode (gpu_mode::Single without one), Batch from what the training dataset
/// yields (torch::data::Example<> for TensorDataset, FashionMNIST, ImageFolder).
template <class ModelArg, class TrainDataset, class GpuMode = gpu_mode::Single>
TrainLoop(ModelArg, TrainDataset, data::AnyDataset<detail::dataset_batch_t<TrainDataset>>, torch::optim::Optimizer&,
          Criterion, TrainLoopOptions = {}, GpuMode = {})
    -> TrainLoop<detail::model_of_handle_t<ModelArg>, GpuMode, detail::dataset_batch_t<TrainDataset>>;

/// @brief The same for the constructor without a criterion (a model that computes its own loss).
template <class ModelArg, class TrainDataset, class GpuMode = gpu_mode::Single>
TrainLoop(ModelArg, TrainDataset, data::AnyDataset<detail::dataset_batch_t<TrainDataset>>, torch::optim::Optimizer&,
          TrainLoopOptions = {}, GpuMode = {})
    -> TrainLoop<detail::model_of_handle_t<ModelArg>, GpuMode, detail::dataset_batch_t<TrainDataset>>;

}  // namespace trainloop
