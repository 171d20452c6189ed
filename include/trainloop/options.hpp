#pragma once
/// @file
/// @brief TrainLoopOptions: batch sizes, loader workers, seed, accumulation, clipping, metrics.

#include <trainloop/error.hpp>
#include <trainloop/metrics/metric.hpp>
#include <trainloop/metrics/metric_list.hpp>
#include <trainloop/nn/memory_format.hpp>
#include <trainloop/precision/grad_scaler.hpp>
#include <trainloop/precision/precision.hpp>

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace trainloop {

/// @brief Options of a TrainLoop, in libtorch's fluent style:
/// `TrainLoopOptions().batch_size(128).seed(7).metrics({Accuracy()})`.
struct TrainLoopOptions {
  /// Samples per micro-batch on each process (per rank in DDP; split across replicas in DP).
  TORCH_ARG(int64_t, batch_size) = 64;
  /// Samples per batch during evaluation; 0 means the same as batch_size.
  TORCH_ARG(int64_t, eval_batch_size) = 0;
  /// Background threads that prepare batches ahead of the loop; 0 loads in the loop's thread.
  TORCH_ARG(int64_t, num_workers) = 0;
  /// Seed for shuffling (combined with the epoch) and for torch's generator at the start of fit().
  TORCH_ARG(uint64_t, seed) = 0;
  /// Shuffle the training set every epoch (with a seed that changes every epoch).
  TORCH_ARG(bool, shuffle) = true;
  /// Drop the last incomplete training batch.
  TORCH_ARG(bool, drop_last) = false;
  /// Micro-batches whose gradients are accumulated before each optimizer step.
  TORCH_ARG(int64_t, grad_accumulation_steps) = 1;
  /// Clip the global gradient norm to this value before each step; 0 disables clipping.
  TORCH_ARG(double, clip_grad_norm) = 0.0;
  /// Metrics computed on training and validation data (the loss is always computed): by value
  /// (`{Accuracy(), TopKAccuracy(5)}`, each copied) or as shared_ptrs, as MetricList takes them.
  TORCH_ARG(MetricList, metrics) = {};
  /// Stop with an error when the epoch's training loss is NaN or infinite (every rank agrees).
  TORCH_ARG(bool, stop_on_non_finite_loss) = true;
  /// Intra-op threads of each process (each replica in DataParallel); 0 chooses from the usable
  /// cores (cpu/threads.hpp). OMP_NUM_THREADS, when set, wins over both.
  TORCH_ARG(int, num_threads) = 0;
  /// Numeric precision of the forward pass: fp32, bf16 autocast (CPU, CUDA) or fp16 autocast with
  /// dynamic loss scaling (CUDA) — precision/precision.hpp.
  TORCH_ARG(Precision, precision) = Precision::fp32;
  /// Memory format of the model's 4-d tensors and inputs: automatic (channels-last for models with
  /// a 2-d convolution), contiguous or channels_last — nn/memory_format.hpp.
  TORCH_ARG(MemoryFormat, memory_format) = MemoryFormat::automatic;
  /// On a CUDA device, assemble batches in pinned host memory (in the loader's threads) and copy
  /// them with `non_blocking`, so the copy no longer stalls the training thread — PyTorch's
  /// `DataLoader(pin_memory=True)`. Ignored on the CPU.
  TORCH_ARG(bool, pin_memory) = true;
  /// The loss scaler's settings for Precision::fp16.
  TORCH_ARG(GradScalerOptions, grad_scaler) = {};
  /// Record every optimizer step (learning rate, momentum, loss) in History::steps. Reading the
  /// loss synchronises with the device once per step.
  TORCH_ARG(bool, record_steps) = false;
  /// DDP: the model's trainloop::nn::SyncBatchNorm layers normalise with the statistics of the
  /// global batch of every rank (nn/sync_batch_norm.hpp). Off: each rank uses its own batch's, as
  /// torch::nn::BatchNorm does (Lightning's default; fastai's DistributedTrainer turns it on).
  TORCH_ARG(bool, sync_batchnorm) = false;
  /// DDP: when the ranks' last batches differ in size (the epoch is not a multiple of world size x
  /// batch size), weigh each rank's gradient by its samples, so that every step equals one process
  /// training on the ranks' combined batch; training shards are then not padded with repeated
  /// samples, and a rank without samples in the last batch takes part with none
  /// (loop/epoch_batch_plan.hpp). false: PyTorch's DistributedSampler way — shards padded by
  /// repeating samples, ranks weighted equally. Kept padded with sync_batchnorm (its forward is a
  /// collective every rank must join). Costs no communication; with equal batches the results are
  /// bit for bit the same either way.
  TORCH_ARG(bool, exact_uneven_batches) = true;
  /// Show a ProgressBar in every fit() that has none among its callbacks: by default (nullopt)
  /// when standard output is a terminal; `true` always (one line per epoch into a file or pipe),
  /// `false` never.
  TORCH_ARG(std::optional<bool>, progress) = std::nullopt;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::Error naming the first option that is out of range.
  void validate() const {
    TRAINLOOP_CHECK(batch_size_ > 0, "batch size is ", batch_size_, "; expected a positive number");
    TRAINLOOP_CHECK(eval_batch_size_ >= 0, "eval batch size is ", eval_batch_size_,
                    "; expected a positive number, or 0 for the training batch size");
    TRAINLOOP_CHECK(num_workers_ >= 0, "num_workers is ", num_workers_, "; expected 0 or more");
    TRAINLOOP_CHECK(grad_accumulation_steps_ >= 1, "grad_accumulation_steps is ", grad_accumulation_steps_,
                    "; expected 1 or more");
    TRAINLOOP_CHECK(clip_grad_norm_ >= 0.0, "clip_grad_norm is ", clip_grad_norm_, "; expected 0 (off) or a positive norm");
    for (const auto& metric : metrics_) TRAINLOOP_CHECK(metric != nullptr, "a metric in the options is null");
    // A metric's name keys its value in History, the CSV and TensorBoard: a second one of the
    // same name would silently overwrite the first.
    for (size_t i = 0; i < metrics_.size(); ++i) {
      for (size_t j = i + 1; j < metrics_.size(); ++j) {
        TRAINLOOP_CHECK(metrics_[i]->name() != metrics_[j]->name(), "metrics ", i + 1, " and ", j + 1, " of the options ",
                        "are both named '", metrics_[i]->name(), "'; expected distinct names (each names its value in ",
                        "History, the CSV and TensorBoard)");
      }
    }
    TRAINLOOP_CHECK(num_threads_ >= 0, "num_threads is ", num_threads_, "; expected 0 (automatic) or a positive count");
  }
  /// @brief The evaluation batch size after applying the 0 = batch_size rule.
  int64_t effective_eval_batch_size() const { return eval_batch_size_ > 0 ? eval_batch_size_ : batch_size_; }
};

/// @brief How long fit() trains: a number of epochs, or an exact number of optimizer steps.
class FitLength {
 public:
  /// @brief Train for `n` whole epochs. @throws trainloop::ConfigurationError unless n > 0.
  static FitLength epochs(int64_t n) { return FitLength(n, 0, "epochs"); }
  /// @brief Train for exactly `n` optimizer steps, crossing epochs as needed.
  /// @throws trainloop::ConfigurationError unless n > 0.
  static FitLength iterations(int64_t n) { return FitLength(0, n, "iterations"); }
  /// @brief Epochs asked for (0 when fitting by iterations).
  int64_t epoch_count() const { return epochs_; }
  /// @brief Steps asked for (0 when fitting by epochs).
  int64_t iteration_count() const { return iterations_; }

 private:
  FitLength(int64_t epochs, int64_t iterations, const char* unit) : epochs_(epochs), iterations_(iterations) {
    const int64_t asked = epochs != 0 ? epochs : iterations;
    TRAINLOOP_CHECK(asked > 0, "fit length is ", asked, " ", unit, "; expected a positive number of ", unit);
  }
  int64_t epochs_;
  int64_t iterations_;
};

}  // namespace trainloop
