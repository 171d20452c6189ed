#pragma once
/// @file
/// @brief Sharded gradients (FSDP's SHARD_GRAD_OP and FULL_SHARD): each unit's gradients are
/// reduce-scattered as soon as backward has produced them all, so each rank receives only its
/// chunk of the average and the whole local gradients are released at once (what lives on is 1/W).
///
/// A post-hook on each parameter's gradient accumulator counts the unit's gradients in; when a
/// unit is complete (in the micro-batch that synchronizes), its gradients are scaled by 1/W and
/// reduce-scattered into this rank's chunk (unit_gradient). Units are reduced in a fixed order
/// (last unit first, the order backward produces them in), as the gradient reducer's buckets are,
/// so every rank issues the same collectives; finalize() reduces the units whose hooks did not
/// complete (unused parameters: zeros). Micro-batches that do not synchronize (gradient
/// accumulation) keep the whole local gradients until the one that does.
///
/// Every rank must run the same operators on the same parameters in the same order (the same
/// model, no per-rank choice of layers or experts): the reductions are collectives.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/progress/collective_log.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace trainloop::distributed {

namespace detail {

/// The shared state of the gradient hooks (held weakly by them; guarded by `mutex`).
struct UnitGradientState {
  std::mutex mutex;
  bool synchronize = false;                // this micro-batch reduces
  std::vector<int> unit_of_hooked;         // hooked parameter i belongs to this unit
  std::vector<int> expected, arrived;      // per unit: hooked parameters, and those whose gradient is in
  std::vector<char> reduced;               // per unit: reduced this step
  size_t next = 0;                         // position in the fixed order of the next unit to reduce
  std::function<void(size_t)> reduce;      // reduces one unit (UnitGradients::reduce_unit)
  std::vector<size_t> order;               // the fixed order: last unit first

  void on_gradient(size_t hooked) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!synchronize) return;  // accumulation: the whole local gradient stays
    ++arrived[static_cast<size_t>(unit_of_hooked[hooked])];
    while (next < order.size() && arrived[order[next]] >= expected[order[next]]) reduce_next();
  }
  void reduce_next() {
    const size_t unit = order[next++];
    if (!reduced[unit] && expected[unit] > 0) reduce(unit);  // a unit all frozen has nothing to reduce
    reduced[unit] = 1;
  }
};

class UnitGradientHook final : public ::trainloop::detail::AutogradPostHook {
 public:
  UnitGradientHook(std::weak_ptr<UnitGradientState> state, size_t index) : state_(std::move(state)), index_(index) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    if (auto state = state_.lock()) state->on_gradient(index_);
    return outputs;
  }

 private:
  std::weak_ptr<UnitGradientState> state_;
  size_t index_;
};

}  // namespace detail

/// @brief The reduce-scatter of every unit's gradients during backward, for one fit (this
/// file's comment); owns this rank's reduced chunk of each unit's gradient.
class UnitGradients {
 public:
  /// Hooks the gradients of `layout`'s units.
  UnitGradients(std::shared_ptr<const FlatLayout> layout, ProcessGroup& group)
      : layout_(std::move(layout)), group_(group) {
    const auto& distinct = layout_->distinct();
    for (size_t u = 0; u < layout_->unit_count(); ++u) {
      chunks_.push_back(torch::zeros({layout_->unit_chunk(u)}, distinct.empty() ? torch::TensorOptions()
                                                                                : distinct.front().options()));
    }
    attach_hooks();
  }
  UnitGradients(const UnitGradients&) = delete;
  UnitGradients& operator=(const UnitGradients&) = delete;
  ~UnitGradients() { remove_hooks(); }

  /// This rank's reduced chunk of each unit's gradient (zeros until the first reduction).
  const std::vector<torch::Tensor>& chunks() const { return chunks_; }

  /// Before a micro-batch's forward: whether it reduces (re-hooked first when a parameter was
  /// frozen or unfrozen since).
  void begin_micro_batch(bool synchronize) {
    if (trainable_set_changed()) attach_hooks();
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->synchronize = synchronize;
  }
  /// Before the optimizer step: reduces the units backward did not complete, in the fixed order
  /// (a rank without samples reduces them all here), and starts the next step's count.
  void finalize() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    while (state_->next < state_->order.size()) state_->reduce_next();
    state_->synchronize = false;  // a backward outside the loop (a callback's) reduces nothing
    state_->next = 0;
    std::fill(state_->arrived.begin(), state_->arrived.end(), 0);
    std::fill(state_->reduced.begin(), state_->reduced.end(), 0);
    staging_ = torch::Tensor();  // the step's temporaries may use the memory
  }

 private:
  /// Reduce-scatters unit `u`'s gradients into this rank's chunk, releasing the whole local ones
  /// as they are copied. Called with the gradient state's mutex held. The input is one buffer of
  /// the largest unit's size kept over the step's reductions: a fresh one per unit cost a page
  /// fault per 4 KiB of it (of the 100 M MLP's 64 MiB units, 14% of a full-sharding step's time
  /// went to the kernel zeroing pages; benchmarks/README.md, zero_memory).
  void reduce_unit(size_t u) {
    torch::NoGradGuard no_grad;
    torch::Tensor& chunk = chunks_[u];
    const int64_t length = group_.world_size() * chunk.numel();
    if (!staging_.defined() || staging_.numel() < length) staging_ = torch::empty({length}, chunk.options());
    torch::Tensor input = staging_.narrow(0, 0, length);
    int64_t filled = 0;  // the unit's tensors lie end to end from 0: zeros only where none wrote
    for (auto& [parameter, offset] : layout_->unit_tensors(u)) {
      const torch::Tensor& grad = parameter.grad();
      torch::Tensor target = input.narrow(0, offset, parameter.numel());
      if (!grad.defined()) {
        target.zero_();  // unused or frozen: zeros, as the gradient reducer sends
      } else {
        target.copy_(::trainloop::distributed::detail::flat_in_layout_of(grad, parameter));
        // Released as soon as copied: the collective then runs beside one copy of the unit's
        // gradient, not two (64 MiB less at the peak of the 100 M MLP's 64 MiB units).
        parameter.mutable_grad().reset();
      }
      filled = std::max(filled, offset + parameter.numel());
    }
    if (filled < length) input.narrow(0, filled, length - filled).zero_();  // the last chunk's padding
    input.mul_(1.0 / group_.world_size());  // the average, scaled before the sum as the gradient reducer does
    const progress::CollectiveLabel label("gradients of unit", static_cast<int>(u), static_cast<int>(layout_->unit_count()));
    group_.reduce_scatter_sum(input, chunk);
  }

  /// Whether a parameter was frozen or unfrozen since the hooks were attached (checked before
  /// every micro-batch: a flag read per parameter, no allocation).
  bool trainable_set_changed() const {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      if (parameters_[i].requires_grad() != (hooked_flags_[i] != 0)) return true;
    }
    return false;
  }

  /// (Re)attaches a gradient hook to every parameter that requires grad now.
  void attach_hooks() {
    remove_hooks();
    state_ = std::make_shared<detail::UnitGradientState>();
    const size_t units = layout_->unit_count();
    state_->expected.assign(units, 0);
    state_->arrived.assign(units, 0);
    state_->reduced.assign(units, 0);
    for (size_t u = units; u-- > 0;) state_->order.push_back(u);
    state_->reduce = [this](size_t u) { reduce_unit(u); };
    parameters_.clear();
    hooked_flags_.clear();
    for (size_t u = 0; u < units; ++u) {
      for (auto& [parameter, offset] : layout_->unit_tensors(u)) {
        parameters_.push_back(parameter);
        hooked_flags_.push_back(parameter.requires_grad() ? 1 : 0);
        if (!parameter.requires_grad()) continue;
        trainloop::detail::AutogradNodePtr accumulator = torch::autograd::impl::grad_accumulator(parameter);
        hook_keys_.push_back(accumulator->add_post_hook(
            std::make_unique<detail::UnitGradientHook>(state_, state_->unit_of_hooked.size())));
        accumulators_.push_back(std::move(accumulator));
        state_->unit_of_hooked.push_back(static_cast<int>(u));
        ++state_->expected[u];
      }
    }
  }
  void remove_hooks() noexcept {
    for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
    accumulators_.clear();
    hook_keys_.clear();
  }

  std::shared_ptr<const FlatLayout> layout_;
  ProcessGroup& group_;
  std::vector<torch::Tensor> chunks_;  // this rank's reduced chunk of each unit's gradient
  torch::Tensor staging_;              // the reduce-scatter's input, reused over a step's units
  std::shared_ptr<detail::UnitGradientState> state_;
  std::vector<trainloop::detail::AutogradNodePtr> accumulators_;  // kept alive: autograd holds them weakly
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<torch::Tensor> parameters_;  // every unit's parameters, in layout order
  std::vector<char> hooked_flags_;         // which of them had a hook attached (required grad then)
};

}  // namespace trainloop::distributed
