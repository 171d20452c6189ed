#pragma once
/// @file
/// @brief AnyDataset<Batch>: a type-erased, shared handle to any libtorch dataset, so a TrainLoop
/// accepts TensorDataset, FashionMNIST, a user's torch::data::Dataset or BatchDataset alike.

#include <trainloop/data/batch_loader.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <functional>
#include <optional>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief A dataset that yields ready batches of type `Batch` for a list of indices.
///
/// Wraps any dataset with `get_batch(c10::ArrayRef<size_t>)` and `size()`. When the wrapped
/// dataset returns `std::vector<torch::data::Example<>>` (a plain `torch::data::Dataset` that
/// defines only `get()`), the examples are stacked into one `torch::data::Example<>`.
/// Copies share the wrapped dataset.
template <class Batch = torch::data::Example<>>
class AnyDataset {
 public:
  using BatchType = Batch;                          ///< what get_batch() returns
  using BatchRequestType = c10::ArrayRef<size_t>;  ///< what get_batch() takes

  /// @brief No dataset (e.g. no validation set).
  AnyDataset() = default;

  /// @brief Wraps a dataset by value (it is moved into shared storage).
  template <class Dataset>
    requires(!std::is_same_v<std::decay_t<Dataset>, AnyDataset>)
  AnyDataset(Dataset dataset)  // NOLINT(google-explicit-constructor): implicit by design
      : AnyDataset(std::make_shared<std::decay_t<Dataset>>(std::move(dataset))) {}

  /// @brief Wraps a dataset shared with the caller.
  template <class Dataset>
  AnyDataset(std::shared_ptr<Dataset> dataset) {  // NOLINT(google-explicit-constructor)
    TRAINLOOP_CHECK(dataset != nullptr, "a null dataset was given");
    auto size = dataset->size();
    TRAINLOOP_CHECK(size.has_value(), "the dataset has no size; trainloop needs a sized (map-style) dataset");
    size_ = *size;
    get_batch_ = [dataset](c10::ArrayRef<size_t> indices) -> Batch {
      using Collate = trainloop::detail::BatchCollate<decltype(dataset->get_batch(indices))>;
      static_assert(std::is_convertible_v<typename Collate::type, Batch>,
                    "trainloop: the dataset's batches are not of the TrainLoop's Batch type (its third template "
                    "argument, torch::data::Example<> by default)");
      return Collate::apply(dataset->get_batch(indices));
    };
    if constexpr (requires { dataset->set_epoch(uint64_t{}); }) {
      set_epoch_ = [dataset](uint64_t epoch) { dataset->set_epoch(epoch); };
    }
    if constexpr (requires { dataset->classes().size(); }) {  // ImageFolder
      num_classes_ = static_cast<int64_t>(dataset->classes().size());
    } else if constexpr (requires { { dataset->num_classes() } -> std::convertible_to<std::optional<int64_t>>; }) {
      num_classes_ = dataset->num_classes();  // TensorDataset given num_classes, FashionMNIST
    }
  }

  /// @brief True when a dataset is held.
  bool has_value() const { return static_cast<bool>(get_batch_); }
  /// @brief Number of samples.
  size_t size() const { return size_; }
  /// @brief Tells a dataset with epoch-dependent samples (random augmentation: ImageFolder) which
  /// epoch is being read; the training loop calls it before each epoch. No-op for other datasets.
  void set_epoch(uint64_t epoch) const {
    if (set_epoch_) set_epoch_(epoch);
  }
  /// @brief Number of classes, when the dataset says (`classes()` of an ImageFolder,
  /// `num_classes()` of a TensorDataset given one); none otherwise. MixUp learns it from here.
  std::optional<int64_t> num_classes() const { return num_classes_; }
  /// @brief The batch for `indices` (in that order).
  Batch get_batch(c10::ArrayRef<size_t> indices) const {
    TRAINLOOP_CHECK(has_value(), "no dataset was given");
    return get_batch_(indices);
  }

 private:
  std::function<Batch(c10::ArrayRef<size_t>)> get_batch_;
  std::function<void(uint64_t)> set_epoch_;
  size_t size_ = 0;
  std::optional<int64_t> num_classes_;
};

}  // namespace trainloop::data

namespace trainloop::detail {

/// The Batch a dataset yields, as AnyDataset collates it: what TrainLoop's deduction guides take
/// for the loop's Batch. A dataset without `get_batch(c10::ArrayRef<size_t>)` (a shared_ptr is
/// looked through) gives torch::data::Example<>, and AnyDataset's own check then says what is wrong.
template <class Dataset>
struct dataset_batch {
  using type = torch::data::Example<>;
};
template <class Dataset>
  requires requires(Dataset& dataset, c10::ArrayRef<size_t> indices) { dataset.get_batch(indices); }
struct dataset_batch<Dataset> {
  using type = typename BatchCollate<decltype(std::declval<Dataset&>().get_batch(
      std::declval<c10::ArrayRef<size_t>>()))>::type;
};
template <class Dataset>
struct dataset_batch<std::shared_ptr<Dataset>> : dataset_batch<Dataset> {};
template <class Dataset>
using dataset_batch_t = typename dataset_batch<std::remove_cvref_t<Dataset>>::type;

}  // namespace trainloop::detail
