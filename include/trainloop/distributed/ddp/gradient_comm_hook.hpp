#pragma once
/// @file
/// @brief GradientCommHook: how DDP's GradientReducer communicates one full bucket of gradients —
/// the seam for gradient compression (fp16/bf16 casts, PowerSGD) and any user scheme, one class —
/// and CommFuture, what a hook's launch() returns (c10d's shape: `runHook` returns a future, and
/// PowerSGD chains its second round with `then()`).
///
/// Without a hook the reducer all-reduces (sums) each bucket asynchronously; the bucket holds this
/// rank's gradients already multiplied by 1/world size, so the sum is the mean. A hook replaces that
/// step: launch() starts its first round and returns a CommFuture; `.then(round)` adds a round that
/// starts once the one before completed (it may compute and start collectives, and returns the next
/// CommFuture); `.then(finish)` adds local work (returning nothing, no collectives) that leaves the
/// averaged gradients in the bucket, from which the reducer writes every parameter's grad.
///
/// Where each part runs, and why: the reducer calls launch() and runs the rounds on its own
/// communication thread, bucket after bucket in bucket order, each bucket's rounds before the next
/// bucket's launch() — so every rank issues the same collectives in the same order (Gloo and NCCL
/// match collectives by order), while the autograd thread that filled the bucket goes on with
/// backward at once, never waiting for a round and never holding the reducer's lock meanwhile.
/// The last round's collective stays in flight; finalize() waits for it and runs the finishing
/// steps. A hook's launch(), rounds and finishing steps for one bucket never run concurrently with
/// each other; launch() of the next bucket may run while earlier buckets' last rounds are in flight.
///
/// The reducer counts the bytes each rank puts on the wire per step (GradientReducer::
/// last_step_bytes_sent()): a hook says what a bucket's launch and rounds sent through
/// bytes_sent(), in the ring model every backend uses for large tensors (ring_all_reduce_bytes,
/// ring_all_gather_bytes).
///
/// Until this API (CHANGELOG.md), launch() returned a WorkHandle and a separate finish() wrote
/// the result, and a multi-round hook had to wait inside launch(), blocking backward.

#include <trainloop/distributed/comm/process_group.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// Bytes one rank sends to all-reduce `bytes` over `world_size` ranks with a ring (reduce-scatter
/// then all-gather: 2(W-1)/W of the tensor), the algorithm of Gloo's and NCCL's large all-reduces.
inline std::int64_t ring_all_reduce_bytes(std::int64_t bytes, int world_size) {
  return world_size <= 1 ? 0 : 2 * bytes * (world_size - 1) / world_size;
}

/// Bytes one rank sends to all-gather its `bytes` to `world_size` ranks with a ring ((W-1) times
/// its part: every part passes every rank once).
inline std::int64_t ring_all_gather_bytes(std::int64_t bytes, int world_size) {
  return world_size <= 1 ? 0 : bytes * (world_size - 1);
}

/// @brief Where each parameter's gradient sits in one bucket (for hooks that compress matrices).
struct BucketLayout {
  std::vector<std::int64_t> offsets;              ///< first element of each gradient in the flat bucket
  std::vector<std::vector<std::int64_t>> shapes;  ///< each gradient's shape, in slot order
};

/// @brief One bucket's communication under way, and what follows it (see the file comment).
///
/// @code
///   // Two rounds and a finishing step (PowerSGD's shape):
///   return CommFuture(group.all_reduce_sum_async(p))
///       .then([=] { /* orthonormalise P, Q = Mᵀ P */ return CommFuture(group.all_reduce_sum_async(q)); })
///       .then([=] { /* write P Qᵀ into the bucket */ });
/// @endcode
class CommFuture {
 public:
  /// Nothing to wait for.
  CommFuture() = default;
  /// Completes when `work` (a collective started by the hook) has completed.
  explicit CommFuture(WorkHandle work) : work_(std::move(work)) {}

  /// Adds a step after everything added so far. `next` returning CommFuture is a round: it may
  /// start collectives; the reducer runs it on its communication thread, in bucket order, once the
  /// work before it completed. `next` returning void is a finishing step: local work only (it must
  /// not start collectives), run in finalize() after the last round's work completed.
  template <class Next>
  CommFuture then(Next&& next) && {
    using Result = std::invoke_result_t<Next&>;
    static_assert(std::is_void_v<Result> || std::is_same_v<Result, CommFuture>,
                  "CommFuture::then takes a callable returning CommFuture (another round) or void (a finishing step)");
    Step step;
    if constexpr (std::is_void_v<Result>) {
      step.finish = std::forward<Next>(next);
    } else {
      step.round = std::forward<Next>(next);
    }
    steps_.push_back(std::move(step));
    return std::move(*this);
  }

  /// Runs every round, in order, each after the work before it completed (`wait` waits for a
  /// work, e.g. ProcessGroup::wait); finishing steps that come before a round run here too.
  /// Leaves the last round's work in flight and the trailing finishing steps for complete().
  template <class Wait>
  void run_rounds(Wait&& wait) {
    while (has_round()) {
      Step step = std::move(steps_.front());
      steps_.erase(steps_.begin());
      if (work_) wait(work_);
      work_.reset();
      if (step.finish) {
        step.finish();
        continue;
      }
      CommFuture next = step.round();
      work_ = std::move(next.work_);
      steps_.insert(steps_.begin(), std::make_move_iterator(next.steps_.begin()),
                    std::make_move_iterator(next.steps_.end()));
    }
  }

  /// Waits for the work in flight and runs the finishing steps (after run_rounds()).
  template <class Wait>
  void complete(Wait&& wait) {
    run_rounds(wait);
    if (work_) wait(work_);
    work_.reset();
    for (auto& step : steps_) step.finish();
    steps_.clear();
  }

 private:
  struct Step {
    std::function<CommFuture()> round;  // set for a round
    std::function<void()> finish;       // set for a finishing step
  };
  bool has_round() const {
    for (const auto& step : steps_) {
      if (step.round) return true;
    }
    return false;
  }

  WorkHandle work_;
  std::vector<Step> steps_;
};

/// @brief Communicates one gradient bucket across the ranks (see the file comment).
class GradientCommHook {
 public:
  virtual ~GradientCommHook() = default;
  /// Called once when the hook is attached to a reducer, before any launch(): every bucket's
  /// layout, in bucket (launch) order. The default ignores it.
  virtual void on_buckets_formed(const std::vector<BucketLayout>& /*buckets*/) {}
  /// @brief Starts reducing one bucket across the ranks; called on the reducer's communication
  /// thread, in bucket order.
  /// @param group the ranks' process group (alive as long as the reducer)
  /// @param index the bucket's position in launch order (0 = the first to fill in backward)
  /// @param flat the bucket: this rank's gradients times 1/world size, contiguous, on the group's
  ///        device; the hook leaves the mean in it by the end of its last step (the same tensor
  ///        may be captured by the steps)
  /// @return the first round's work and the steps that follow (a bare `CommFuture(work)` when the
  ///         collective leaves the mean in `flat` itself)
  virtual CommFuture launch(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) = 0;
  /// Bytes this rank sent for the last launch() of bucket `index` and its rounds (`flat` as given
  /// to it), asked once the rounds ran. The default is an all-reduce of `flat` itself; a hook that
  /// sends something else says what.
  virtual std::int64_t bytes_sent(std::size_t /*index*/, const torch::Tensor& flat, int world_size) const {
    return ring_all_reduce_bytes(flat.numel() * static_cast<std::int64_t>(flat.element_size()), world_size);
  }
  /// Writes what the hook carries from one step to the next (PowerSGD's Q and error feedback),
  /// this rank's own: DDP checkpoints keep every rank's, so a resumed run with the same world size
  /// continues where the interrupted one was. Called after on_buckets_formed(). The default: nothing.
  virtual void save_state(torch::serialize::OutputArchive& /*archive*/) const {}
  /// Reads what save_state() wrote on this rank, after on_buckets_formed(). A state that does
  /// not fit the buckets formed now is best ignored (the hook starts afresh, as in a new run).
  virtual void load_state(torch::serialize::InputArchive& /*archive*/) {}
};

}  // namespace trainloop::distributed
