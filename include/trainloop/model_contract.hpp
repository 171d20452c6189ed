#pragma once
/// @file
/// @brief How the loop talks to a model: the default (input, target) contract, or the model's own
/// loss and prediction for other batch types — chosen at compile time.
///
/// Default contract (batches of `torch::data::Example<>`):
///   `output = model->forward(batch.data); loss = criterion(output, batch.target);`
///
/// Custom contract (any batch type, like aitoolbox's TTModel `get_loss` / `get_predictions`):
///   the model's module defines
///   - `torch::Tensor batch_loss(const Batch& batch, trainloop::Criterion& criterion)` — the mean loss,
///     or `torch::Tensor batch_loss(const Batch& batch)` for a model whose loss needs no criterion;
///   - `trainloop::Predictions batch_predictions(const Batch& batch)` — outputs and targets for metrics.
///   The batch type provides `int64_t batch_size() const` and, to be moved to the mode's device,
///   `Batch to(torch::Device) const` (without it the model moves what it needs itself).
///   When both contracts fit, the custom one wins. A model with the custom contract may be given
///   no criterion at all (TrainLoop's constructor without one).

#include <trainloop/detail/error_context.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <concepts>
#include <functional>
#include <memory>
#include <type_traits>

namespace trainloop {

/// @brief A loss function of (output, target) returning the mean loss over the batch, e.g. a
/// `torch::nn::CrossEntropyLoss` or a lambda.
using Criterion = std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&)>;

/// @brief A model's outputs for a batch with the matching targets (custom contract).
struct Predictions {
  torch::Tensor output;  ///< model outputs, first dimension = samples
  torch::Tensor target;  ///< targets the metrics compare against
};

/// @brief What one forward pass over a batch produced.
struct StepOutput {
  torch::Tensor loss;     ///< mean loss over the batch's samples (with graph when training)
  torch::Tensor output;   ///< detached outputs, undefined when the model gives none
  torch::Tensor target;   ///< targets, undefined when the model gives none
  int64_t samples = 0;    ///< samples in the batch
};

namespace detail {

template <class T>
inline constexpr bool is_module_holder_v = std::is_base_of_v<torch::detail::ModuleHolderIndicator, std::decay_t<T>>;

/// The module class behind a model type: `Net` for both `Net` (a TORCH_MODULE holder's impl) and its holder.
template <class Model, bool = is_module_holder_v<Model>>
struct module_of {
  using type = Model;
};
template <class Model>
struct module_of<Model, true> {
  using type = typename Model::ContainedType;
};
template <class Model>
using module_t = typename module_of<Model>::type;

template <class Batch>
inline constexpr bool is_example_batch_v = std::is_same_v<std::decay_t<Batch>, torch::data::Example<>>;

template <class Impl, class Batch>
concept HasDefaultContract = is_example_batch_v<Batch> && requires(Impl& module, torch::Tensor input) {
  { module.forward(input) } -> std::convertible_to<torch::Tensor>;
};

/// The module's own loss that takes the loop's criterion: `batch_loss(batch, criterion)`.
template <class Impl, class Batch>
concept HasLossWithCriterion = requires(Impl& module, const Batch& batch, Criterion& criterion) {
  { module.batch_loss(batch, criterion) } -> std::convertible_to<torch::Tensor>;
};

/// The module's own loss that needs no criterion: `batch_loss(batch)`.
template <class Impl, class Batch>
concept HasLossWithoutCriterion = requires(Impl& module, const Batch& batch) {
  { module.batch_loss(batch) } -> std::convertible_to<torch::Tensor>;
};

/// The custom contract: a loss of the module's own (with or without the criterion) and its predictions.
template <class Impl, class Batch>
concept HasCustomContract = (HasLossWithCriterion<Impl, Batch> || HasLossWithoutCriterion<Impl, Batch>) &&
                            requires(Impl& module, const Batch& batch) {
                              { module.batch_predictions(batch) } -> std::convertible_to<Predictions>;
                            };

template <class Impl, class Batch>
concept ModelContract = HasDefaultContract<Impl, Batch> || HasCustomContract<Impl, Batch>;

/// Produces a static_assert with the instructions when neither contract fits.
template <class Impl, class Batch>
constexpr void require_model_contract() {
  static_assert(ModelContract<Impl, Batch>,
                "trainloop: the model does not fit a training contract. Either (a) define "
                "`torch::Tensor forward(torch::Tensor input)` and train on batches of "
                "torch::data::Example<> (input, target), or (b) define both "
                "`torch::Tensor batch_loss(const Batch&, trainloop::Criterion&)` (or `batch_loss(const Batch&)`) "
                "returning the mean loss and `trainloop::Predictions batch_predictions(const Batch&)` in the model's "
                "module.");
}

/// Produces a static_assert when a loop built without a criterion would need one.
template <class Impl, class Batch>
constexpr void require_own_loss() {
  static_assert(HasCustomContract<Impl, Batch>,
                "trainloop: a TrainLoop built without a criterion needs a model that computes its own loss: define "
                "`torch::Tensor batch_loss(const Batch&)` (or `batch_loss(const Batch&, trainloop::Criterion&)`) and "
                "`trainloop::Predictions batch_predictions(const Batch&)` in the model's module, or pass a criterion "
                "such as torch::nn::CrossEntropyLoss() to the constructor (a model with only forward() needs one).");
}

/// The criterion of a loop built without one. The custom contract never calls it unless the
/// model's `batch_loss(batch, criterion)` does: then the error says what is missing, where a
/// default std::function would throw a bare std::bad_function_call.
inline Criterion missing_criterion() {
  return [](const torch::Tensor&, const torch::Tensor&) -> torch::Tensor {
    throw ConfigurationError(
        "trainloop: the model's batch_loss(batch, criterion) called the criterion, but the TrainLoop was built "
        "without one; expected a criterion passed to the TrainLoop constructor, or a batch_loss(batch) that needs none");
  };
}

/// Number of samples in a batch.
template <class Batch>
int64_t batch_size_of(const Batch& batch) {
  if constexpr (is_example_batch_v<Batch>) {
    return batch.data.size(0);
  } else {
    static_assert(requires { { batch.batch_size() } -> std::convertible_to<int64_t>; },
                  "trainloop: a custom batch type must provide `int64_t batch_size() const`");
    return static_cast<int64_t>(batch.batch_size());
  }
}

/// Moves a batch to a device (non-blocking where the copy allows it).
template <class Batch>
Batch batch_to_device(const Batch& batch, const torch::Device& device) {
  if constexpr (is_example_batch_v<Batch>) {
    if (batch.data.device() == device && (!batch.target.defined() || batch.target.device() == device)) return batch;
    return {batch.data.to(device, /*non_blocking=*/true),
            batch.target.defined() ? batch.target.to(device, /*non_blocking=*/true) : batch.target};
  } else if constexpr (requires { { batch.to(device) } -> std::convertible_to<Batch>; }) {
    return batch.to(device);
  } else {
    return batch;
  }
}


/// Throws a clear error when integer class labels fall outside the model's output classes.
inline void check_labels_in_range(const torch::Tensor& output, const torch::Tensor& target) {
  if (!target.defined() || output.dim() != 2 || target.dim() != 1) return;
  if (target.scalar_type() != torch::kLong && target.scalar_type() != torch::kInt) return;
  if (target.numel() == 0) return;
  const int64_t classes = output.size(1);
  auto bad = (target < 0).logical_or(target >= classes);
  if (!bad.any().item<bool>()) return;
  auto position = bad.nonzero()[0][0].item<int64_t>();
  auto label = target[position].item<int64_t>();
  throw ConfigurationError(concat("trainloop: label ", label, " (sample ", position, " of the batch) is out of range: the model outputs ",
                     classes, " classes, so labels must be in [0, ", classes, ")"));
}

/// One forward pass with the model's contract. `training` keeps the loss graph.
template <class Impl, class Batch>
StepOutput forward_batch(Impl& module, const Batch& batch, Criterion& criterion, bool check_labels) {
  require_model_contract<Impl, Batch>();
  StepOutput out;
  out.samples = batch_size_of(batch);
  if constexpr (HasCustomContract<Impl, Batch>) {
    try {
      if constexpr (HasLossWithCriterion<Impl, Batch>) {
        out.loss = module.batch_loss(batch, criterion);
      } else {
        out.loss = module.batch_loss(batch);
      }
    } catch (const c10::Error&) {
      rethrow_with_context("trainloop: the model's batch_loss() failed");
    }
    if (!torch::GradMode::is_enabled()) {
      Predictions predictions = module.batch_predictions(batch);
      out.output = predictions.output.detach();
      out.target = predictions.target;
    }
  } else {
    torch::Tensor output;
    try {
      output = module.forward(batch.data);
    } catch (const c10::Error&) {
      // Same error object and type (c10::OutOfMemoryError stays catchable), with the shape fed.
      rethrow_with_context(concat("trainloop: the model's forward() on an input batch of shape ", batch.data.sizes(),
                                  " failed"));
    }
    if (check_labels) check_labels_in_range(output, batch.target);
    try {
      out.loss = criterion(output, batch.target);
    } catch (const c10::Error&) {
      rethrow_with_context(concat("trainloop: the criterion on output of shape ", output.sizes(),
                                  " and target of shape ", batch.target.sizes(), " failed"));
    }
    TRAINLOOP_CHECK(out.loss.numel() == 1, "the criterion returned a loss of shape ", out.loss.sizes(),
                    "; expected a scalar (mean over the batch)");
    out.output = output.detach();
    out.target = batch.target;
  }
  return out;
}

/// Holds the model the way the caller gave it: a TORCH_MODULE holder shares its module; a
/// plain module type is held through a shared_ptr.
template <class Model>
class ModelHandle {
 public:
  using module_type = module_t<Model>;
  using stored_type = std::conditional_t<is_module_holder_v<Model>, Model, std::shared_ptr<Model>>;

  explicit ModelHandle(stored_type model) : model_(std::move(model)) {}
  /// The module, as a reference.
  module_type& module() const { return *shared(); }
  /// The module, as a shared_ptr (for APIs that take one).
  std::shared_ptr<module_type> shared() const {
    if constexpr (is_module_holder_v<Model>) {
      return model_.ptr();
    } else {
      return model_;
    }
  }
  /// The model in the caller's form.
  const stored_type& get() const { return model_; }

 private:
  stored_type model_;
};

template <class>
inline constexpr bool always_false_v = false;

/// The Model of TrainLoop's deduction guides, from the model handle given to the constructor: a
/// TORCH_MODULE holder (torch::nn::Sequential, `Net` for `NetImpl`) is the Model itself; a
/// `std::shared_ptr<Impl>` makes the Model `Impl`.
template <class Handle>
struct model_of_handle {
  static_assert(always_false_v<Handle>,
                "trainloop: TrainLoop cannot deduce its Model from the model argument: expected a TORCH_MODULE holder "
                "(torch::nn::Sequential, Net for NetImpl) or a std::shared_ptr to the module, or the Model named as "
                "in TrainLoop<Model>");
};
template <class Handle>
  requires is_module_holder_v<Handle>
struct model_of_handle<Handle> {
  using type = Handle;
};
template <class Impl>
struct model_of_handle<std::shared_ptr<Impl>> {
  using type = Impl;
};
template <class Handle>
using model_of_handle_t = typename model_of_handle<std::remove_cvref_t<Handle>>::type;

}  // namespace detail
}  // namespace trainloop
