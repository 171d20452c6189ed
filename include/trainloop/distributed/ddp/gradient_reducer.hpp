#pragma once
/// @file
/// @brief trainloop::distributed::GradientReducer: DDP's gradient averaging, overlapped with backward.
///
/// What torch's c10d::Reducer does, written on the public autograd API (the Reducer's header does
/// not compile against Debian's libtorch, and its constructor changed three times in 2.x):
///
/// - Parameters are packed into flat buckets in *reverse* registration order (gradients of the
///   last layers arrive first in backward), one bucket per dtype/device at a time; the first
///   bucket is small (~1 MiB) so communication starts early, the rest ~25 MiB.
/// - Each contiguous parameter's `param.grad` *is* its slot of the bucket (gradient_as_bucket_view,
///   the default: the constructor points every grad there, keeping its values), so backward
///   accumulates into the bucket itself. With gradient_as_bucket_view off, grads are tensors of
///   their own and the slot receives a copy.
/// - A post-hook on each parameter's gradient accumulator (the AccumulateGrad node) runs right
///   after `param.grad` has been accumulated; it multiplies the slot by 1/world_size (copying the
///   gradient in first where the grad is not the slot). (`Tensor::register_hook` would not do: it
///   sees the incoming gradient *before* accumulation, so grad-accumulation steps would be lost.)
/// - A bucket whose slots are all filled is all-reduced (SUM, asynchronously) while backward goes
///   on — but strictly in bucket order: bucket k starts only after buckets 0..k-1, so every rank
///   issues the same collectives in the same order even when gradients arrive in another order.
/// - finalize(), after backward and before the optimizer step, fills the slots whose hook did not
///   run (parameters unused this step: their current grad, or zeros), launches the remaining
///   buckets, waits, and leaves the averages in every `param.grad` (a grad that is its slot holds
///   them already; another is pointed at its slot, or, with views off, receives a copy).
///
/// The reducer keeps the accumulator nodes alive (autograd holds them only weakly, and a new
/// node would not carry our hook). Hooks hold the shared state weakly and the destructor removes
/// them, so the module may outlive the reducer. Hooks may run on autograd worker threads (CUDA
/// backward); all shared state is guarded by one mutex. With a comm hook (set_comm_hook), a full
/// bucket is handed to the reducer's communication thread, which runs the hook's launch() and
/// rounds in bucket order without the mutex; finalize() waits for the hook's futures.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_buckets.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// Bucket sizes and overlap mode of a GradientReducer.
struct GradientReducerOptions {
  /// Cap of the first bucket (the first to fill in backward): small, so communication starts early.
  std::int64_t first_bucket_cap_bytes = std::int64_t{1} << 20;
  /// Cap of every later bucket. A bucket closes once it reaches its cap, so a bucket may exceed
  /// it by one parameter, and a parameter larger than the cap gets a bucket of its own.
  std::int64_t bucket_cap_bytes = std::int64_t{25} << 20;
  /// true: all-reduce buckets from the hooks, during backward. false: hooks are idle and
  /// finalize() does one pass of bucket all-reduces after backward (the no-overlap baseline).
  bool overlap = true;
  /// Keep each contiguous parameter's `param.grad` as a view of its bucket slot (PyTorch DDP's
  /// gradient_as_bucket_view): backward accumulates straight into the bucket, the all-reduce
  /// averages in place, and a rank holds one copy of the gradients instead of two, with no copy
  /// in or out. Results are bit for bit those of the copies (the same operations on the same
  /// values). A non-contiguous parameter (a channels-last convolution weight) keeps its own
  /// gradient: a slot is laid out contiguously. A gradient replaced or reset by user code is
  /// copied in and pointed back at its slot by the next finalize().
  bool gradient_as_bucket_view = true;
};

/// Averages gradients across the ranks of a ProcessGroup with bucketed, ordered, asynchronous
/// all-reduces launched from autograd hooks (see the file comment). Per step:
/// `loss.backward(); reducer.finalize(); optimizer.step();`.
class GradientReducer {
 public:
  /// Attaches hooks to `parameters` that require grad (others are ignored; duplicates — tied
  /// weights — count once) and forms the buckets. Every rank must pass the same parameters in
  /// the same order. @throws trainloop::Error if a parameter is not a leaf or caps are not positive.
  GradientReducer(const std::vector<torch::Tensor>& parameters, ProcessGroup group,
                  GradientReducerOptions options = {})
      : state_(std::make_shared<detail::ReducerState>()) {
    TRAINLOOP_CHECK(options.first_bucket_cap_bytes > 0 && options.bucket_cap_bytes > 0, "bucket caps are ",
                    options.first_bucket_cap_bytes, " and ", options.bucket_cap_bytes, " bytes; expected > 0");
    TRAINLOOP_CHECK(group.valid(), "GradientReducer needs a ProcessGroup made by ProcessGroup::create()");
    state_->group = std::move(group);
    state_->overlap = options.overlap;
    state_->scale = 1.0 / state_->group.world_size();
    std::unordered_set<const void*> seen;
    for (const auto& parameter : parameters) {
      if (parameter.requires_grad() && seen.insert(parameter.unsafeGetTensorImpl()).second) {
        TRAINLOOP_CHECK(parameter.is_leaf(), "parameter #", state_->parameters.size(),
                        " is not a leaf tensor; expected module parameters");
        state_->parameters.push_back(parameter);
      }
    }
    state_->form_buckets(options.first_bucket_cap_bytes, options.bucket_cap_bytes);
    if (options.gradient_as_bucket_view) point_gradients_at_buckets();
    attach_hooks();
  }

  /// Same, for all parameters of `module` that require grad.
  GradientReducer(const torch::nn::Module& module, ProcessGroup group, GradientReducerOptions options = {})
      : GradientReducer(module.parameters(/*recurse=*/true), std::move(group), options) {}

  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  /// Removes the hooks and stops the comm hook's thread; the parameters' gradient accumulators
  /// are left as they were before.
  ~GradientReducer() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->alive = false;
    }
    state_->stop_comm_thread();
    for (std::size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  }

  /// Completes this step's reduction: fills slots of parameters whose hook did not run (their
  /// current grad, zeros if undefined), launches the remaining buckets in order, waits for all,
  /// and leaves the average in each param.grad (its slot, or a copy where views are off), so
  /// every rank ends with identical gradients. Call after backward, before the optimizer step, on every rank.
  /// Does nothing while sync is disabled (gradients keep accumulating locally).
  void finalize() {
    std::unique_lock<std::mutex> lock(state_->mutex);
    if (!state_->sync) return;
    try {
      for (std::size_t i = 0; i < state_->parameters.size(); ++i) {
        if (!state_->filled[i]) state_->fill_slot(i);
      }
      state_->launch_ready_buckets(/*from_hook=*/false);
      if (state_->hook) {
        // The hook's futures: every bucket launched and its rounds run (on the communication
        // thread), then each last round waited for and its finishing steps run, in bucket order.
        state_->wait_for_comm_thread(lock);
        lock.unlock();  // no other thread touches the buckets now; don't hold the mutex meanwhile
        for (auto& bucket : state_->buckets) {
          if (bucket.error) std::rethrow_exception(bucket.error);
        }
        for (auto& bucket : state_->buckets) {
          bucket.future.complete([this](const WorkHandle& work) { state_->group.wait(work, "gradient comm hook"); });
        }
      } else {
        std::vector<WorkHandle> works;
        for (const auto& bucket : state_->buckets) works.push_back(bucket.work);
        lock.unlock();  // waiting needs no state; don't block other threads on the mutex meanwhile
        for (const auto& work : works) state_->group.wait(work, "gradient all-reduce");
      }
      lock.lock();
      copy_results_to_grads();
      state_->reset_step();
    } catch (...) {
      if (!lock.owns_lock()) lock.lock();
      state_->wait_for_comm_thread(lock);  // it may still be on a bucket: let it finish first
      state_->reset_step();  // a failed step must not poison the next one
      throw;
    }
  }

  /// Enables or disables reduction. Disabled: hooks do nothing and finalize() is a no-op, so
  /// gradients accumulate locally (gradient-accumulation micro-steps); the next step with sync
  /// enabled reduces the accumulated gradients.
  /// @throws trainloop::Error when called between a synced backward and its finalize().
  void set_sync(bool enabled) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TRAINLOOP_CHECK(enabled == state_->sync || !state_->step_in_progress(),
                    "set_sync(", enabled ? "true" : "false",
                    ") called between backward and finalize(); expected it before backward or after finalize()");
    state_->sync = enabled;
  }

  /// Communicates each bucket with `hook` instead of an all-reduce sum (null: back to the
  /// all-reduce); see distributed/ddp/gradient_comm_hook.hpp. Every rank must set the same kind of hook.
  /// @throws trainloop::Error when called between a synced backward and its finalize().
  void set_comm_hook(std::shared_ptr<GradientCommHook> hook) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TRAINLOOP_CHECK(!state_->step_in_progress(), "set_comm_hook() called between backward and finalize(); "
                    "expected it before backward or after finalize()");
    if (hook) {
      std::vector<BucketLayout> layouts;
      for (const auto& bucket : state_->buckets) {
        BucketLayout layout;
        for (std::size_t index : bucket.parameters) {
          layout.offsets.push_back(state_->slots[index].offset);
          layout.shapes.push_back(state_->parameters[index].sizes().vec());
        }
        layouts.push_back(std::move(layout));
      }
      hook->on_buckets_formed(layouts);
      state_->start_comm_thread();
    }
    state_->hook = std::move(hook);
  }

  /// Whether reduction is enabled.
  bool sync_enabled() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->sync;
  }

  /// RAII scope with reduction disabled (like DDP's `no_sync()`); restores the previous setting.
  class NoSyncGuard {
   public:
    /// Disables reduction on `reducer` until this guard is destroyed.
    explicit NoSyncGuard(GradientReducer& reducer) : reducer_(reducer), previous_(reducer.sync_enabled()) {
      reducer_.set_sync(false);
    }
    /// Restores the setting found at construction.
    ~NoSyncGuard() {
      std::lock_guard<std::mutex> lock(reducer_.state_->mutex);
      reducer_.state_->sync = previous_;  // sync was off, so no step can be in progress
    }
    NoSyncGuard(const NoSyncGuard&) = delete;
    NoSyncGuard& operator=(const NoSyncGuard&) = delete;

   private:
    GradientReducer& reducer_;
    bool previous_;
  };

  /// `auto guard = reducer.no_sync();` — reduction disabled until `guard` goes out of scope.
  [[nodiscard]] NoSyncGuard no_sync() { return NoSyncGuard(*this); }

  /// Number of bucket all-reduces launched since construction.
  std::int64_t allreduce_count() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->allreduce_count;
  }

  /// Bytes this rank sent for gradients since construction (ring model, gradient_comm_hook.hpp):
  /// 2(W-1)/W of every bucket all-reduced in its dtype, or what the comm hook reports.
  std::int64_t bytes_sent() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->bytes_sent;
  }

  /// Bytes this rank sent for the gradients of the last finalized synced step (as bytes_sent()).
  std::int64_t last_step_bytes_sent() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->last_step_bytes_sent;
  }

  /// Number of buckets.
  std::size_t bucket_count() const { return state_->buckets.size(); }

  /// Whether parameter `index` (of parameters()) has its gradient as a view of its bucket slot.
  bool gradient_is_bucket_view(std::size_t index) const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->bucket_view.at(index) && state_->is_slot(index, state_->parameters.at(index).grad());
  }

  /// The parameters being reduced (those requiring grad, deduplicated), in the given order.
  const std::vector<torch::Tensor>& parameters() const { return state_->parameters; }

  /// Bucket indices in the order they were launched in the last finalized synced step.
  std::vector<std::size_t> last_launch_order() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->last_launch_order;
  }

  /// How many buckets of the last finalized synced step were launched from hooks, i.e. during
  /// backward (0 with overlap=false).
  std::size_t last_launched_during_backward() const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->last_launched_from_hooks;
  }

 private:
  void attach_hooks() {
    for (std::size_t i = 0; i < state_->parameters.size(); ++i) {
      trainloop::detail::AutogradNodePtr accumulator = torch::autograd::impl::grad_accumulator(state_->parameters[i]);
      TRAINLOOP_CHECK(accumulator, "parameter #", i, " has no gradient accumulator; expected a leaf that requires grad");
      hook_keys_.push_back(accumulator->add_post_hook(std::make_unique<detail::GradientReadyHook>(state_, i)));
      accumulators_.push_back(std::move(accumulator));
    }
  }

  /// gradient_as_bucket_view: every contiguous parameter's grad becomes its slot, holding the
  /// gradient it had (a rebuilt reducer keeps what was accumulated), or zeros.
  void point_gradients_at_buckets() {
    torch::NoGradGuard no_grad;
    state_->bucket_view.assign(state_->parameters.size(), 0);
    for (std::size_t i = 0; i < state_->parameters.size(); ++i) {
      torch::Tensor& parameter = state_->parameters[i];
      if (!parameter.is_contiguous() || parameter.is_sparse()) continue;
      torch::Tensor& grad = parameter.mutable_grad();
      if (grad.defined() && grad.is_sparse()) continue;
      torch::Tensor slot = state_->slot_as_gradient(i);
      if (grad.defined()) slot.copy_(grad);
      grad = slot;
      state_->bucket_view[i] = 1;
    }
  }

  /// Writes each bucket's averaged values back into param.grad (a gradient kept as a bucket view
  /// holds them already, or is pointed back at its slot). Caller holds the lock.
  void copy_results_to_grads() {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < state_->parameters.size(); ++i) {
      const auto& slot = state_->slots[i];
      torch::Tensor& parameter = state_->parameters[i];
      if (state_->bucket_view[i]) {
        if (!state_->is_slot(i, parameter.grad())) parameter.mutable_grad() = state_->slot_as_gradient(i);
        continue;
      }
      torch::Tensor result = state_->buckets[slot.bucket].flat.narrow(0, slot.offset, slot.numel).view(parameter.sizes());
      torch::Tensor& grad = parameter.mutable_grad();
      if (grad.defined()) {
        grad.copy_(result);
      } else {
        grad = torch::empty_like(parameter).copy_(result);  // same layout as AccumulateGrad would make
      }
    }
  }

  std::shared_ptr<detail::ReducerState> state_;
  std::vector<trainloop::detail::AutogradNodePtr> accumulators_;
  std::vector<std::uintptr_t> hook_keys_;
};

}  // namespace trainloop::distributed
