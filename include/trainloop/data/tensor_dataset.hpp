#pragma once
/// @file
/// @brief `trainloop::data::TensorDataset`: an in-memory dataset whose batches are one
/// `index_select` per tensor.
///
/// libtorch's own `torch::data::datasets::TensorDataset` returns one example per index and the
/// loader stacks them afterwards: a copy per sample plus a stack per batch. Here a batch is a
/// single gather, which is what makes small models (MNIST-sized MLPs) loader-bound otherwise.

#include <trainloop/error.hpp>

#include <torch/data/datasets/base.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

namespace trainloop::data {

/// @brief A dataset over two tensors whose first dimension is the sample index.
///
/// `get_batch(indices)` gathers the selected rows of inputs and targets with one `index_select`
/// each, on whichever device the tensors live. Safe to call from several loader threads at once
/// (it only reads the tensors).
class TensorDataset
    : public torch::data::datasets::BatchDataset<TensorDataset, torch::data::Example<>> {
 public:
  /// @brief Wraps `inputs` (N, ...) and `targets` (N, ...); the tensors are shared, not copied.
  /// @param inputs the model inputs, sample index first.
  /// @param targets the targets, sample index first.
  /// @param num_classes when given, `targets` must be an integer tensor with every value in
  ///        [0, num_classes); checked here once so a bad label fails at load time, not as an
  ///        out-of-range index deep inside the loss.
  /// @throws trainloop::Error when a tensor is empty or undefined, the first dimensions differ,
  ///         or a label is out of range.
  TensorDataset(torch::Tensor inputs, torch::Tensor targets,
                std::optional<int64_t> num_classes = std::nullopt)
      : inputs_(std::move(inputs)), targets_(std::move(targets)), num_classes_(num_classes) {
    validate_shapes();
    if (num_classes_) validate_labels(*num_classes_);
  }

  /// @brief The rows at `indices`, stacked: inputs (B, ...) and targets (B, ...).
  /// @throws trainloop::Error when an index is not below size().
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    check_indices(indices);
    static_assert(sizeof(size_t) == sizeof(int64_t), "indices are reinterpreted as int64");
    // Viewing the caller's size_t array as int64 avoids a copy; indices are < 2^63.
    const auto index =
        torch::from_blob(const_cast<size_t*>(indices.data()),  // NOLINT: read only
                         {static_cast<int64_t>(indices.size())}, torch::kLong)
            .to(inputs_.device(), /*non_blocking=*/true);  // no GPU stall per batch
    const auto target_index =
        targets_.device() == inputs_.device() ? index : index.to(targets_.device());
    return {inputs_.index_select(0, index), targets_.index_select(0, target_index)};
  }

  /// @brief One example: row `index` of inputs and of targets (views, not copies).
  /// @throws trainloop::Error when `index` is not below size().
  torch::data::Example<> get(size_t index) const {
    TRAINLOOP_CHECK(index < sample_count(), "sample index ", index,
                    " is out of range; expected an index below the dataset size ",
                    sample_count());
    const auto i = static_cast<int64_t>(index);
    return {inputs_[i], targets_[i]};
  }

  /// @brief The number of samples N.
  c10::optional<size_t> size() const override { return sample_count(); }

  /// @brief All inputs, (N, ...).
  const torch::Tensor& inputs() const noexcept { return inputs_; }
  /// @brief All targets, (N, ...).
  const torch::Tensor& targets() const noexcept { return targets_; }
  /// @brief The class count given at construction, if any (every label is below it).
  std::optional<int64_t> num_classes() const noexcept { return num_classes_; }

 private:
  size_t sample_count() const noexcept { return static_cast<size_t>(inputs_.size(0)); }

  void validate_shapes() const {
    TRAINLOOP_CHECK(inputs_.defined() && targets_.defined(),
                    "TensorDataset got an undefined ", inputs_.defined() ? "targets" : "inputs",
                    " tensor; expected two defined tensors");
    TRAINLOOP_CHECK(inputs_.dim() > 0 && targets_.dim() > 0,
                    "TensorDataset got a 0-dimensional ", inputs_.dim() == 0 ? "inputs" : "targets",
                    " tensor; expected the sample index as first dimension");
    TRAINLOOP_CHECK(inputs_.size(0) == targets_.size(0), "TensorDataset inputs have ",
                    inputs_.size(0), " samples but targets have ", targets_.size(0),
                    "; expected the same first dimension");
    TRAINLOOP_CHECK(inputs_.size(0) > 0,
                    "TensorDataset got 0 samples; expected a non-empty dataset");
  }

  void validate_labels(int64_t classes) const {
    TRAINLOOP_CHECK(classes > 0, "num_classes is ", classes, "; expected a positive number");
    TRAINLOOP_CHECK(c10::isIntegralType(targets_.scalar_type(), /*includeBool=*/false),
                    "TensorDataset targets have dtype ", targets_.scalar_type(),
                    " but num_classes was given; expected an integer label tensor");
    const auto flat = targets_.reshape({-1});
    const auto bad = flat.lt(0).logical_or_(flat.ge(classes));
    if (!bad.any().item<bool>()) return;
    const int64_t position = bad.nonzero()[0][0].item<int64_t>();
    const int64_t value = flat[position].item<int64_t>();
    const int64_t per_sample = flat.numel() / targets_.size(0);
    if (per_sample == 1) {
      TRAINLOOP_CHECK(false, "label ", value, " at index ", position,
                      " is out of range; expected every label in [0, ", classes,
                      ") for num_classes = ", classes);
    }
    TRAINLOOP_CHECK(false, "label ", value, " at flat index ", position, " (sample ",
                    position / per_sample, ") is out of range; expected every label in [0, ",
                    classes, ") for num_classes = ", classes);
  }

  void check_indices(c10::ArrayRef<size_t> indices) const {
    if (indices.empty()) return;
    const size_t largest = *std::max_element(indices.begin(), indices.end());
    TRAINLOOP_CHECK(largest < sample_count(), "batch index ", largest,
                    " is out of range; expected indices below the dataset size ",
                    sample_count());
  }

  torch::Tensor inputs_;
  torch::Tensor targets_;
  std::optional<int64_t> num_classes_;
};

}  // namespace trainloop::data
