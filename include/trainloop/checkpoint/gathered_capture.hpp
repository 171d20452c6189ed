#pragma once
/// @file
/// @brief Host buffers standing in for the live parameters and optimizer state in a gathered
/// checkpoint's archive (checkpoint/background_gathered_write.hpp), so the next optimizer step
/// waits only for a copy, not for the whole file to be streamed.
///
/// At the checkpoint's step, on the training thread, the archive is built with a buffer in place
/// of each parameter (checkpoint/module_snapshot.hpp) and of each tensor of the optimizer's state
/// (OptimizerStandIns: libtorch's Adam, AdamW, SGD, Adagrad and RMSprop, swapped in for the
/// serialization and back); the writer's thread then copies the live tensors into the buffers
/// while the next forward and backward run (they change neither) and tells the training thread
/// (its optimizer step waits for that), then streams the archive from the buffers. A job's
/// checkpoints reuse one set of buffers (one checkpoint is in flight at a time): host memory of
/// the size of the model and its optimizer state, as a per-rank checkpoint's ShareCapture.
///
/// Where a tensor cannot be stood in for — not on the CPU (a device's file records its device),
/// not owning its storage exactly (the file pickles the whole storage), an optimizer state of
/// another type — the archive holds the live tensor, complete() is false, and the optimizer step
/// waits for the stream as before. Either way the file is the foreground's, value for value.
///
/// ~100 M-parameter MLP with Adam, 1.2 GB, plain DDP on 2 CPU ranks (AMD EPYC, 2 cores,
/// `benchmarks/run_checkpoint_stall.sh build 2 none --every 4 --steps 16`): training blocked 753 ms
/// per checkpoint (median) with the copy, 2,076 ms when the step waited for the stream, 4,506 ms in
/// the foreground; the total cost the same within the spread (benchmarks/README.md, "checkpoint_stall").

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// @brief Buffers standing in for live tensors in a gathered checkpoint's archive (see the file comment).
class GatheredCapture {
 public:
  /// Starts the next checkpoint's plan: the previous one's buffers become spares, reused in order.
  void begin() {
    spare_.clear();
    for (auto& pair : pairs_) spare_.push_back(std::move(pair.buffer));
    pairs_.clear();
    complete_ = true;
  }

  /// What the archive holds in place of `live`: a buffer of the same sizes, strides, type and
  /// requires_grad, filled by copy(); or `live` itself when it cannot be stood in for (then
  /// complete() is false).
  torch::Tensor stand_in(const torch::Tensor& live) {
    if (!live.defined()) return live;
    const bool own_storage = live.layout() == torch::kStrided && live.has_storage() && live.device().is_cpu() &&
                             live.storage_offset() == 0 && live.storage().nbytes() == live.nbytes() &&
                             live.is_non_overlapping_and_dense();
    if (!own_storage) {
      complete_ = false;
      return live;
    }
    for (const auto& pair : pairs_) {  // tied tensors (one storage): one buffer, as the file holds one storage
      if (pair.live.data_ptr() != live.data_ptr()) continue;
      if (pair.live.sizes() == live.sizes() && pair.live.strides() == live.strides() && pair.live.dtype() == live.dtype()) {
        return pair.buffer;
      }
      complete_ = false;
      return live;
    }
    torch::Tensor buffer;
    const size_t index = pairs_.size();
    if (index < spare_.size()) {
      const torch::Tensor& old = spare_[index];
      if (old.scalar_type() == live.scalar_type() && old.sizes() == live.sizes() && old.strides() == live.strides()) buffer = old;
    }
    if (!buffer.defined()) buffer = torch::empty_strided(live.sizes(), live.strides(), live.options().requires_grad(false));
    buffer.requires_grad_(live.requires_grad());
    pairs_.push_back({live.detach(), buffer});
    return buffer;
  }

  /// Copies every live tensor into its buffer (one memcpy each: no intra-op thread team is started
  /// from the writer's thread); stops early (returns false) when `cancelled` is set. Any thread,
  /// once per plan, before the next optimizer step.
  bool copy(const std::atomic<bool>& cancelled) {
    for (const auto& pair : pairs_) {
      if (cancelled.load()) return false;
      if (pair.live.nbytes() > 0) std::memcpy(pair.buffer.data_ptr(), pair.live.data_ptr(), pair.live.nbytes());
    }
    return true;
  }

  /// Marks the plan incomplete: the archive holds a tensor the next optimizer step changes.
  void mark_incomplete() { complete_ = false; }
  /// Whether every tensor the next optimizer step changes is stood in for: then the step waits
  /// only for copy(), else for the whole stream.
  bool complete() const { return complete_; }
  /// Bytes of host memory the buffers hold.
  int64_t buffer_bytes() const {
    int64_t bytes = 0;
    for (const auto& pair : pairs_) bytes += static_cast<int64_t>(pair.buffer.nbytes());
    return bytes;
  }

 private:
  struct Pair {
    torch::Tensor live;
    torch::Tensor buffer;
  };
  std::vector<Pair> pairs_;
  std::vector<torch::Tensor> spare_;
  bool complete_ = true;
};

/// @brief While it lives, the optimizer's state tensors are `capture`'s buffers (for the archive
/// written meanwhile); the live ones are put back when it ends. libtorch's Adam, AdamW, SGD,
/// Adagrad and RMSprop; any other state type marks the capture incomplete. Training thread.
class OptimizerStandIns {
 public:
  /// Swaps the buffers in.
  OptimizerStandIns(torch::optim::Optimizer& optimizer, GatheredCapture& capture) {
    namespace optim = torch::optim;
    for (auto& entry : optimizer.state()) {
      optim::OptimizerParamState* state = entry.second.get();
      if (auto* adam = dynamic_cast<optim::AdamParamState*>(state)) {
        swap(capture, adam->exp_avg(), [adam](const torch::Tensor& t) { adam->exp_avg(t); });
        swap(capture, adam->exp_avg_sq(), [adam](const torch::Tensor& t) { adam->exp_avg_sq(t); });
        swap(capture, adam->max_exp_avg_sq(), [adam](const torch::Tensor& t) { adam->max_exp_avg_sq(t); });
      } else if (auto* adamw = dynamic_cast<optim::AdamWParamState*>(state)) {
        swap(capture, adamw->exp_avg(), [adamw](const torch::Tensor& t) { adamw->exp_avg(t); });
        swap(capture, adamw->exp_avg_sq(), [adamw](const torch::Tensor& t) { adamw->exp_avg_sq(t); });
        swap(capture, adamw->max_exp_avg_sq(), [adamw](const torch::Tensor& t) { adamw->max_exp_avg_sq(t); });
      } else if (auto* sgd = dynamic_cast<optim::SGDParamState*>(state)) {
        swap(capture, sgd->momentum_buffer(), [sgd](const torch::Tensor& t) { sgd->momentum_buffer(t); });
      } else if (auto* adagrad = dynamic_cast<optim::AdagradParamState*>(state)) {
        swap(capture, adagrad->sum(), [adagrad](const torch::Tensor& t) { adagrad->sum(t); });
      } else if (auto* rmsprop = dynamic_cast<optim::RMSpropParamState*>(state)) {
        swap(capture, rmsprop->square_avg(), [rmsprop](const torch::Tensor& t) { rmsprop->square_avg(t); });
        swap(capture, rmsprop->momentum_buffer(), [rmsprop](const torch::Tensor& t) { rmsprop->momentum_buffer(t); });
        swap(capture, rmsprop->grad_avg(), [rmsprop](const torch::Tensor& t) { rmsprop->grad_avg(t); });
      } else {
        capture.mark_incomplete();
      }
    }
  }
  OptimizerStandIns(const OptimizerStandIns&) = delete;
  OptimizerStandIns& operator=(const OptimizerStandIns&) = delete;
  /// Puts the live tensors back.
  ~OptimizerStandIns() {
    for (auto& swapped : swapped_) swapped.set(swapped.live);
  }

 private:
  struct Swapped {
    torch::Tensor live;
    std::function<void(const torch::Tensor&)> set;
  };

  void swap(GatheredCapture& capture, const torch::Tensor& live, std::function<void(const torch::Tensor&)> set) {
    if (!live.defined()) return;
    const torch::Tensor buffer = capture.stand_in(live);
    swapped_.push_back({live, set});
    set(buffer);
  }

  std::vector<Swapped> swapped_;
};

}  // namespace trainloop::detail
