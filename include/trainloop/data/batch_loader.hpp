#pragma once
/// @file
/// @brief `trainloop::data::BatchLoader<Dataset>`: one pass over a list of sample indices in
/// batches, optionally prefetched by background threads, always delivered in order.
///
/// The index list comes from a sampler (ShardSampler::indices()), so the loader knows nothing
/// about ranks or epochs; make one loader per epoch, or reset() it with the next list.

#include <trainloop/data/pinned_batch.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <ATen/Config.h>
#include <ATen/Parallel.h>
#include <torch/arg.h>
#include <torch/data/example.h>
#include <torch/types.h>

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <exception>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief Options of BatchLoader: `BatchLoaderOptions(64).num_workers(2).drop_last(true)`.
struct BatchLoaderOptions {
  /// @param batch_size samples per batch (the last batch may be smaller unless drop_last).
  explicit BatchLoaderOptions(size_t batch_size) : batch_size_(batch_size) {}
  /// Samples per batch; must be positive.
  TORCH_ARG(size_t, batch_size);
  /// 0: batches are loaded in the calling thread when asked for. k > 0: k background threads
  /// load batches ahead of the consumer.
  TORCH_ARG(size_t, num_workers) = 0;
  /// Drop a last batch smaller than batch_size instead of yielding it.
  TORCH_ARG(bool, drop_last) = false;
  /// With workers, at most `prefetch_factor * num_workers` batches are loaded ahead of the
  /// consumer (PyTorch's DataLoader default is 2): bounds the memory held by the queue.
  TORCH_ARG(size_t, prefetch_factor) = 2;
  /// Assemble every batch in page-locked ("pinned") host memory, in the loading thread, so that
  /// its copy to a CUDA device can run with `non_blocking` instead of stalling the training thread
  /// (PyTorch's `DataLoader(pin_memory=True)`). Needs a libtorch with CUDA; TrainLoop sets it when
  /// it trains on a CUDA device (TrainLoopOptions::pin_memory).
  TORCH_ARG(bool, pin_memory) = false;
};

}  // namespace trainloop::data

namespace trainloop::detail {

/// Turns what a dataset's get_batch returns into what the loader yields: plain
/// torch::data::Dataset subclasses return one Example per sample, which are stacked into one;
/// every other batch type is already a batch and is passed through.
template <class DatasetBatch>
struct BatchCollate {
  using type = DatasetBatch;
  static type apply(DatasetBatch&& batch) { return std::move(batch); }
};

template <>
struct BatchCollate<std::vector<torch::data::Example<>>> {
  using type = torch::data::Example<>;
  static type apply(std::vector<torch::data::Example<>>&& examples) {
    std::vector<torch::Tensor> data;
    std::vector<torch::Tensor> targets;
    data.reserve(examples.size());
    targets.reserve(examples.size());
    for (auto& example : examples) {
      data.push_back(std::move(example.data));
      targets.push_back(std::move(example.target));
    }
    return {torch::stack(data), torch::stack(targets)};
  }
};

}  // namespace trainloop::detail

namespace trainloop::data {

/// @brief Yields `dataset.get_batch(chunk)` for consecutive chunks of an index list.
///
/// With `num_workers == 0` a batch is loaded when next() is called. With k workers, k threads
/// load batches ahead (at most prefetch_factor * k), and next() still returns them in index
/// order. An exception thrown while loading batch b is rethrown by the next() that would have
/// returned batch b; later batches can still be taken. Destroying the loader mid-pass stops
/// the workers and joins them (after the batches they are loading finish). With workers,
/// `Dataset::get_batch` is called from several threads at once and must be safe for that
/// (TensorDataset's is). Single pass: call reset() to go over new indices.
///
/// @tparam Dataset a torch::data BatchDataset whose BatchRequestType is built from
///         `c10::ArrayRef<size_t>` (TensorDataset, FashionMNIST, any torch::data::Dataset).
template <class Dataset>
class BatchLoader {
 public:
  /// What the dataset's get_batch returns.
  using dataset_batch_type = typename Dataset::BatchType;
  /// What the loader yields: Example<> for datasets that return vector<Example<>>, else
  /// dataset_batch_type.
  using batch_type = typename detail::BatchCollate<dataset_batch_type>::type;

  static_assert(std::is_constructible_v<typename Dataset::BatchRequestType, c10::ArrayRef<size_t>>,
                "BatchLoader needs a dataset whose get_batch takes c10::ArrayRef<size_t>");

  /// @brief A loader that shares ownership of `dataset`.
  /// @param dataset the dataset; must not be null.
  /// @param indices the sample indices to visit, in order (e.g. ShardSampler::indices()).
  /// @param options batch size, workers, drop_last.
  /// @throws trainloop::Error for a null dataset or batch size 0.
  BatchLoader(std::shared_ptr<Dataset> dataset, std::vector<size_t> indices,
              BatchLoaderOptions options)
      : dataset_(std::move(dataset)), options_(std::move(options)) {
    TRAINLOOP_CHECK(dataset_ != nullptr, "BatchLoader got a null dataset; expected a dataset");
    TRAINLOOP_CHECK(options_.batch_size() > 0, "batch size ", options_.batch_size(),
                    "; expected a positive number");
    TRAINLOOP_CHECK(options_.prefetch_factor() > 0, "prefetch factor ",
                    options_.prefetch_factor(), "; expected a positive number");
    start(std::move(indices));
  }

  /// @brief A loader over a dataset the caller keeps alive for the loader's lifetime.
  BatchLoader(Dataset& dataset, std::vector<size_t> indices, BatchLoaderOptions options)
      : BatchLoader(std::shared_ptr<Dataset>(std::shared_ptr<Dataset>{}, &dataset),
                    std::move(indices), std::move(options)) {}

  /// @brief Positional form: `BatchLoader(dataset, indices, 64, /*num_workers=*/2)`.
  BatchLoader(std::shared_ptr<Dataset> dataset, std::vector<size_t> indices, size_t batch_size,
              size_t num_workers = 0, bool drop_last = false)
      : BatchLoader(std::move(dataset), std::move(indices),
                    BatchLoaderOptions(batch_size).num_workers(num_workers).drop_last(drop_last)) {}

  /// @brief Positional form over a dataset the caller keeps alive.
  BatchLoader(Dataset& dataset, std::vector<size_t> indices, size_t batch_size,
              size_t num_workers = 0, bool drop_last = false)
      : BatchLoader(dataset, std::move(indices),
                    BatchLoaderOptions(batch_size).num_workers(num_workers).drop_last(drop_last)) {}

  // Workers point at this object.
  BatchLoader(const BatchLoader&) = delete;
  BatchLoader& operator=(const BatchLoader&) = delete;

  /// Stops and joins the workers, even mid-pass.
  ~BatchLoader() { stop(); }

  /// @brief The next batch in order, or nullopt after the last one.
  /// @throws whatever the dataset threw while loading this batch.
  std::optional<batch_type> next() {
    if (next_to_deliver_ >= num_batches_) return std::nullopt;
    const size_t batch = next_to_deliver_;
    if (workers_.empty()) {
      ++next_to_deliver_;  // a failed batch is consumed, as with workers
      return load(batch);
    }
    Slot slot;
    {
      std::unique_lock lock(mutex_);
      batch_ready_.wait(lock, [&] { return slots_[batch % slots_.size()].ready; });
      slot = std::exchange(slots_[batch % slots_.size()], Slot{});
      ++next_to_deliver_;
    }
    space_free_.notify_all();
    if (slot.error) std::rethrow_exception(slot.error);
    return std::move(slot.batch);
  }

  /// @brief Input iterator over the remaining batches; copies share the loader's position.
  class iterator {
   public:
    using iterator_category = std::input_iterator_tag;  ///< single pass
    using value_type = batch_type;                       ///< a batch
    using difference_type = std::ptrdiff_t;              ///< required by std::input_iterator
    using reference = batch_type&;                       ///< the batch, owned by the loader

    /// @brief A detached iterator; equal to end().
    iterator() = default;
    /// @brief The current batch (valid until the next increment).
    reference operator*() const { return *loader_->current_; }
    /// @brief Member access to the current batch.
    batch_type* operator->() const { return &*loader_->current_; }
    /// @brief Loads (or takes from the prefetch queue) the next batch.
    iterator& operator++() {
      loader_->advance();
      return *this;
    }
    /// @brief Same as prefix increment (input iterators return nothing useful here).
    void operator++(int) { ++*this; }
    /// @brief True once the pass is over.
    friend bool operator==(const iterator& it, std::default_sentinel_t) { return it.at_end(); }

   private:
    friend class BatchLoader;
    explicit iterator(BatchLoader* loader) : loader_(loader) {}
    bool at_end() const { return loader_ == nullptr || !loader_->current_.has_value(); }
    BatchLoader* loader_ = nullptr;
  };

  /// @brief Starts iterating: loads the first batch.
  /// @throws trainloop::Error when batches were already taken in this pass (single pass).
  iterator begin() {
    TRAINLOOP_CHECK(next_to_deliver_ == 0, "BatchLoader is a single pass and ",
                    next_to_deliver_, " of ", num_batches_,
                    " batches were already taken; expected reset(indices) before iterating again");
    advance();
    return iterator(this);
  }
  /// @brief The end of the pass.
  std::default_sentinel_t end() const noexcept { return {}; }

  /// @brief Starts a new pass over `indices` (e.g. the next epoch's shard), with the same
  /// options; stops and joins the current workers first.
  void reset(std::vector<size_t> indices) {
    stop();
    start(std::move(indices));
  }

  /// @brief Batches in a full pass: ceil(n / batch_size), or floor with drop_last.
  size_t num_batches() const noexcept { return num_batches_; }
  /// @brief Same as num_batches().
  size_t size() const noexcept { return num_batches_; }
  /// @brief The options given.
  const BatchLoaderOptions& options() const noexcept { return options_; }
  /// @brief The index list of this pass.
  const std::vector<size_t>& indices() const noexcept { return indices_; }
  /// @brief The dataset batches come from.
  Dataset& dataset() const noexcept { return *dataset_; }

 private:
  /// One prefetched batch, or the exception its loading threw.
  struct Slot {
    std::optional<batch_type> batch;
    std::exception_ptr error;
    bool ready = false;
  };

  batch_type load(size_t batch) {
    const size_t first = batch * options_.batch_size();
    const size_t count = std::min(options_.batch_size(), indices_.size() - first);
    auto collated = detail::BatchCollate<dataset_batch_type>::apply(
        dataset_->get_batch(c10::ArrayRef<size_t>(indices_.data() + first, count)));
    if (options_.pin_memory()) return data::pinned_batch(std::move(collated));
    return collated;
  }

  void advance() {
    current_.reset();
    current_ = next();
  }

  void start(std::vector<size_t> indices) {
    indices_ = std::move(indices);
    const size_t size = options_.batch_size();
    num_batches_ = options_.drop_last() ? indices_.size() / size
                                        : (indices_.size() + size - 1) / size;
    next_to_deliver_ = 0;
    next_to_claim_ = 0;
    stopping_ = false;
    current_.reset();
    const size_t workers = std::min(options_.num_workers(), num_batches_);
    if (workers == 0) return;
    slots_ = std::vector<Slot>(options_.prefetch_factor() * workers);
    workers_.reserve(workers);
    // libtorch sets a thread's OpenMP count lazily from a process-wide value that a worker's
    // at::set_num_threads(1) changes: read ours first, so the training thread keeps its count.
    at::get_num_threads();
    for (size_t i = 0; i < workers; ++i) {
      workers_.emplace_back([this, i] {
        // A stall report shows the workers' stacks while the training thread waits for a batch.
        progress::RegisteredThread registered(progress::progress_beacon().threads(), "loader worker", static_cast<int>(i));
        work();
      });
    }
  }

  void stop() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    space_free_.notify_all();
    for (auto& worker : workers_) worker.join();
    workers_.clear();
    slots_.clear();
  }

  /// A worker claims the lowest unclaimed batch once it is within the prefetch window, so the
  /// slot it fills (batch % window) has already been emptied by the consumer.
  void work() {
#if AT_PARALLEL_OPENMP
    // Assembling a batch (index_select, stack) is light: one thread each, so loader workers do not
    // start OpenMP teams that would take cores from the training threads. (With libtorch's native
    // pool the count is process-wide, so it is left alone.)
    at::set_num_threads(1);
#endif
    while (true) {
      size_t batch = 0;
      {
        std::unique_lock lock(mutex_);
        space_free_.wait(lock, [&] {
          return stopping_ || next_to_claim_ >= num_batches_ ||
                 next_to_claim_ < next_to_deliver_ + slots_.size();
        });
        if (stopping_ || next_to_claim_ >= num_batches_) return;
        batch = next_to_claim_++;
      }
      Slot slot;
      try {
        slot.batch.emplace(load(batch));
      } catch (...) {
        slot.error = std::current_exception();
      }
      slot.ready = true;
      {
        std::lock_guard lock(mutex_);
        slots_[batch % slots_.size()] = std::move(slot);
      }
      batch_ready_.notify_all();
    }
  }

  std::shared_ptr<Dataset> dataset_;
  BatchLoaderOptions options_;
  std::vector<size_t> indices_;
  size_t num_batches_ = 0;
  size_t next_to_deliver_ = 0;  // written by the consumer, under mutex_ when workers run
  std::optional<batch_type> current_;  // the batch the iterator points at

  std::mutex mutex_;
  std::condition_variable batch_ready_;  // a slot was filled
  std::condition_variable space_free_;   // a slot was emptied, or stopping
  std::vector<Slot> slots_;
  size_t next_to_claim_ = 0;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace trainloop::data
