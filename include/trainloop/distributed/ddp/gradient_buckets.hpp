#pragma once
/// @file
/// @brief The state GradientReducer shares with its autograd hooks: the flat buckets, which slot
/// of which bucket each parameter's gradient fills, the in-order launch of full buckets
/// (gradient_reducer.hpp explains the scheme), and the communication thread that runs a comm
/// hook's launch and rounds (gradient_comm_hook.hpp says why).

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace trainloop::distributed {

namespace detail {

/// Everything the hooks touch; shared between the reducer and its hooks, guarded by `mutex`.
struct ReducerState {
  struct Slot {
    std::size_t bucket = 0;
    std::int64_t offset = 0;
    std::int64_t numel = 0;
  };
  struct Bucket {
    std::vector<std::size_t> parameters;  // indices into `parameters`, in slot order
    torch::Tensor flat;
    std::size_t pending = 0;  // slots not yet filled this step
    WorkHandle work;          // without a hook: the all-reduce in flight
    CommFuture future;        // with a hook: its last round in flight and its finishing steps
    std::exception_ptr error;  // with a hook: what its launch or a round threw
  };

  std::mutex mutex;
  bool alive = true;
  bool sync = true;
  bool overlap = true;
  ProcessGroup group;
  double scale = 1.0;  // 1 / world_size
  std::shared_ptr<GradientCommHook> hook;  // null: all-reduce sum of each bucket
  std::vector<torch::Tensor> parameters;
  std::vector<Slot> slots;
  std::vector<Bucket> buckets;
  std::vector<char> filled;  // per parameter, this step
  std::vector<char> bucket_view;  // per parameter: its param.grad is kept as a view of its slot
  std::size_t next_to_launch = 0;
  std::vector<std::size_t> launch_order;       // this step
  std::size_t launched_from_hooks = 0;         // this step
  std::vector<std::size_t> last_launch_order;  // previous finalized step
  std::size_t last_launched_from_hooks = 0;
  std::int64_t allreduce_count = 0;
  std::int64_t bytes_sent = 0;            // since construction
  std::int64_t step_bytes_sent = 0;       // this step
  std::int64_t last_step_bytes_sent = 0;  // previous finalized step
  // The hook's communication thread: buckets handed over in order, how many it has finished
  // (launched and run the rounds of) this step, and its stop flag. Started by start_comm_thread().
  std::thread comm_thread;
  std::condition_variable comm_changed;
  std::deque<std::size_t> comm_queue;
  std::size_t comm_handed = 0;  // this step
  std::size_t comm_done = 0;    // this step
  bool comm_stop = false;

  /// Forms the buckets, once (the reducer's constructor): in reverse parameter order, one open
  /// bucket per dtype/device; a bucket closes when it reaches its cap (first cap for the first
  /// bucket of its dtype/device, then the regular cap). Buckets are ordered by their first parameter's position in reverse order, i.e. by
  /// when they are expected to fill — the same order on every rank.
  void form_buckets(std::int64_t first_bucket_cap_bytes, std::int64_t bucket_cap_bytes) {
    struct Open {
      c10::ScalarType dtype;
      c10::Device device;
      std::vector<std::size_t> parameters;
      std::int64_t bytes = 0;
      std::int64_t closed_before = 0;  // how many buckets of this dtype/device were closed already
    };
    std::vector<Open> open;
    std::vector<std::vector<std::size_t>> closed;
    for (std::size_t k = parameters.size(); k-- > 0;) {
      const torch::Tensor& p = parameters[k];
      auto it = std::find_if(open.begin(), open.end(), [&](const Open& o) {
        return o.dtype == p.scalar_type() && o.device == p.device();
      });
      if (it == open.end()) it = open.insert(open.end(), Open{p.scalar_type(), p.device(), {}, 0, 0});
      it->parameters.push_back(k);
      it->bytes += p.numel() * static_cast<std::int64_t>(p.element_size());
      const std::int64_t cap = it->closed_before == 0 ? first_bucket_cap_bytes : bucket_cap_bytes;
      if (it->bytes >= cap) {
        closed.push_back(std::move(it->parameters));
        it->parameters.clear();
        it->bytes = 0;
        ++it->closed_before;
      }
    }
    for (auto& o : open) {
      if (!o.parameters.empty()) closed.push_back(std::move(o.parameters));
    }
    // Position in reverse order of a bucket's first parameter = parameters.size() - 1 - index.
    std::stable_sort(closed.begin(), closed.end(), [](const auto& a, const auto& b) { return a.front() > b.front(); });

    slots.resize(parameters.size());
    filled.assign(parameters.size(), 0);
    bucket_view.assign(parameters.size(), 0);
    for (auto& members : closed) {
      Bucket bucket;
      std::int64_t numel = 0;
      for (std::size_t index : members) {
        slots[index] = {buckets.size(), numel, parameters[index].numel()};
        numel += parameters[index].numel();
      }
      const torch::Tensor& first = parameters[members.front()];
      bucket.flat = torch::zeros({numel}, first.options().requires_grad(false));
      bucket.pending = members.size();
      bucket.parameters = std::move(members);
      buckets.push_back(std::move(bucket));
    }
  }

  /// Called by a hook once parameter `index`'s grad has been accumulated.
  void on_gradient_ready(std::size_t index) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!alive || !sync || !overlap) return;
    TRAINLOOP_CHECK(!filled[index], "the gradient of parameter #", index,
                    " became ready twice in one step; expected one backward per finalize() "
                    "(use no_sync() to accumulate over several backward passes)");
    fill_slot(index);
    launch_ready_buckets(/*from_hook=*/true);
  }

  /// Whether `grad` is parameter `index`'s slot itself (a gradient kept as a bucket view).
  bool is_slot(std::size_t index, const torch::Tensor& grad) const {
    const Slot& slot = slots[index];
    const torch::Tensor& flat = buckets[slot.bucket].flat;
    return grad.defined() && grad.is_contiguous() && grad.numel() == slot.numel &&
           grad.storage().is_alias_of(flat.storage()) && grad.storage_offset() == flat.storage_offset() + slot.offset;
  }

  /// Parameter `index`'s slot shaped as its gradient: a tensor that shares the bucket's storage,
  /// made with set_() rather than as a view, so autograd sees a plain tensor (libtorch 1.13's
  /// zero_grad() calls detach_(), which refuses views).
  torch::Tensor slot_as_gradient(std::size_t index) const {
    torch::NoGradGuard no_grad;
    const Slot& slot = slots[index];
    const torch::Tensor& flat = buckets[slot.bucket].flat;
    const auto sizes = parameters[index].sizes();
    std::vector<std::int64_t> strides(sizes.size(), 1);
    for (std::size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * std::max<std::int64_t>(sizes[d], 1);
    torch::Tensor grad = torch::empty({0}, flat.options());
    grad.set_(flat.storage(), flat.storage_offset() + slot.offset, sizes, strides);
    return grad;
  }

  /// Copies param.grad (zeros when undefined) into its slot, scaled by 1/world; a gradient that
  /// is its slot is only scaled. Caller holds the lock.
  void fill_slot(std::size_t index) {
    torch::NoGradGuard no_grad;
    const Slot& slot = slots[index];
    torch::Tensor view = buckets[slot.bucket].flat.narrow(0, slot.offset, slot.numel);
    const torch::Tensor& grad = parameters[index].grad();
    if (bucket_view[index] && is_slot(index, grad)) {
      view.mul_(scale);
    } else if (grad.defined()) {
      TRAINLOOP_CHECK(!grad.is_sparse(), "parameter #", index, " has a sparse gradient; expected dense gradients");
      view.copy_(grad.reshape({-1}));
      view.mul_(scale);
    } else {
      view.zero_();
    }
    filled[index] = 1;
    --buckets[slot.bucket].pending;
  }

  /// Launches every full bucket that is next in bucket order: all-reduces it, or, with a hook,
  /// hands it to the communication thread (the caller, maybe autograd's thread, goes on at once).
  /// Caller holds the lock.
  void launch_ready_buckets(bool from_hook) {
    while (next_to_launch < buckets.size() && buckets[next_to_launch].pending == 0) {
      Bucket& bucket = buckets[next_to_launch];
      if (hook) {
        comm_queue.push_back(next_to_launch);
        ++comm_handed;
        comm_changed.notify_all();
      } else {
        const progress::CollectiveLabel label("gradient bucket", static_cast<int>(next_to_launch),
                                              static_cast<int>(buckets.size()));
        bucket.work = group.all_reduce_sum_async(bucket.flat);
        const std::int64_t sent = ring_all_reduce_bytes(
            bucket.flat.numel() * static_cast<std::int64_t>(bucket.flat.element_size()), group.world_size());
        bytes_sent += sent;
        step_bytes_sent += sent;
      }
      launch_order.push_back(next_to_launch);
      // Tests kill a rank here: its peers are inside this bucket's all-reduce (test_kill_point.hpp).
      if (launch_order.size() == 1) progress::test_kill_point(progress::KillPoint::Backward);
      launched_from_hooks += from_hook ? 1 : 0;
      ++allreduce_count;
      ++next_to_launch;
    }
  }

  /// Starts the communication thread (once): it takes the buckets handed over, in order, calls
  /// the hook's launch() and runs its rounds — without the lock, so backward and other buckets'
  /// gradients go on meanwhile — and records the future, any error, and the bytes sent.
  void start_comm_thread() {
    if (comm_thread.joinable()) return;
    comm_thread = std::thread([this] {
      std::unique_lock<std::mutex> lock(mutex);
      for (;;) {
        comm_changed.wait(lock, [this] { return comm_stop || !comm_queue.empty(); });
        if (comm_stop) return;
        const std::size_t index = comm_queue.front();
        comm_queue.pop_front();
        const std::shared_ptr<GradientCommHook> running = hook;
        const torch::Tensor flat = buckets[index].flat;
        lock.unlock();
        CommFuture future;
        std::exception_ptr error;
        std::int64_t sent = 0;
        try {
          c10::OptionalDeviceGuard on_device;
          if (flat.is_cuda()) on_device.reset_device(flat.device());
          const progress::CollectiveLabel label("gradient bucket", static_cast<int>(index),
                                                static_cast<int>(buckets.size()));
          future = running->launch(group, index, flat);
          future.run_rounds([this](const WorkHandle& work) { group.wait(work, "gradient comm hook round"); });
          sent = running->bytes_sent(index, flat, group.world_size());
        } catch (...) {
          error = std::current_exception();
        }
        lock.lock();
        buckets[index].future = std::move(future);
        buckets[index].error = error;
        bytes_sent += sent;
        step_bytes_sent += sent;
        ++comm_done;
        comm_changed.notify_all();
      }
    });
  }

  /// Stops and joins the communication thread (it finishes the bucket it is on). Caller does not
  /// hold the lock.
  void stop_comm_thread() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      comm_stop = true;
    }
    comm_changed.notify_all();
    if (comm_thread.joinable()) comm_thread.join();
  }

  /// Waits until the communication thread has finished every bucket handed over this step.
  void wait_for_comm_thread(std::unique_lock<std::mutex>& lock) {
    comm_changed.wait(lock, [this] { return comm_done == comm_handed; });
  }

  /// Forgets this step's progress. Caller holds the lock.
  void reset_step() {
    std::fill(filled.begin(), filled.end(), 0);
    for (Bucket& bucket : buckets) {
      bucket.pending = bucket.parameters.size();
      bucket.work.reset();
      bucket.future = CommFuture();
      bucket.error = nullptr;
    }
    comm_queue.clear();
    comm_handed = 0;
    comm_done = 0;
    next_to_launch = 0;
    last_launch_order = std::move(launch_order);
    launch_order.clear();
    last_launched_from_hooks = launched_from_hooks;
    launched_from_hooks = 0;
    last_step_bytes_sent = step_bytes_sent;
    step_bytes_sent = 0;
  }

  bool step_in_progress() const { return std::find(filled.begin(), filled.end(), 1) != filled.end(); }
};

/// The post-hook attached to one parameter's gradient accumulator.
class GradientReadyHook final : public ::trainloop::detail::AutogradPostHook {
 public:
  GradientReadyHook(std::weak_ptr<ReducerState> state, std::size_t index) : state_(std::move(state)), index_(index) {}

  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto state = state_.lock()) state->on_gradient_ready(index_);
    return outputs;
  }

 private:
  std::weak_ptr<ReducerState> state_;
  std::size_t index_;
};

}  // namespace detail

}  // namespace trainloop::distributed
