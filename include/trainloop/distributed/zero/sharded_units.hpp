#pragma once
/// @file
/// @brief ZeRO levels 2 and 3 (FSDP's SHARD_GRAD_OP and FULL_SHARD) over a model's *units*:
/// submodules whose parameters are laid out as one flat range cut in W equal chunks
/// (ZeroOptimizerShard with a unit per submodule), so each rank owns chunk r of every unit.
///
/// Level 2, sharded gradients: a post-hook on each parameter's gradient accumulator counts the
/// unit's gradients in; when a unit is complete (in the micro-batch that synchronizes), its
/// gradients are scaled by 1/W and reduce-scattered, so each rank receives only its chunk of the
/// average, and the whole local gradients are released at once (what lives on is 1/W). Units are
/// reduced in a fixed order (last unit first, the order backward produces them in), as the
/// gradient reducer's buckets are, so every rank issues the same collectives; finalize() reduces
/// the units whose hooks did not complete (unused parameters: zeros). Micro-batches that do not
/// synchronize (gradient accumulation) keep the whole local gradients until the one that does.
/// The owners step their pieces and broadcast them into every rank's parameters (as level 1).
///
/// Level 3, sharded parameters: every unit's parameters become views of one flat buffer per unit,
/// whose storage is *freed* (0 bytes) while the unit is not in use; this rank's chunk of it
/// (ZeroOptimizerShard::own_shard) is the only copy between uses and what the optimizer steps.
/// libtorch modules have no forward hooks, so the use is seen one level lower: a global
/// RecordFunction callback (ATen's operator observer, the profiler's) looks at each operator's
/// inputs while a micro-batch trains, and when one is a view of a freed unit it all-gathers that
/// unit (and frees the units that were gathered before) before the operator runs. That covers the
/// forward and, because autograd's saved tensors share the freed storage, the backward too: a
/// unit is gathered again when its backward needs its weights. At most the units one operator
/// reads are whole at a time (one, for a model whose operators each read one unit). After the
/// micro-batch all units are freed. Evaluation, a checkpoint and the end of the fit ask for every
/// unit whole (unshard(), a collective; the loop calls it on every rank). The callback needs the
/// operators' inputs (RecordFunction::inputs()), which libtorch's headers assert on in a build
/// without NDEBUG (the library itself is built with it): level 3 requires an NDEBUG build.
///
/// Every rank must run the same operators on the same parameters in the same order (the same
/// model, no per-rank choice of layers or experts): the gathers, and the reductions the gradient
/// hooks start between them, are collectives.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/distributed/zero/units.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
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
  std::function<void(size_t)> reduce;      // reduces one unit (ShardedUnits::reduce_unit)
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

/// @brief Levels 2 and 3 of ZeRO for one fit (the file comment says how they run).
class ShardedUnits {
 public:
  /// Hooks the gradients of `shard`'s units; with `parameters_sharded` (level 3) also moves each
  /// unit's parameters into a flat buffer and watches the operators. The parameters must be
  /// whole and the same on every rank.
  ShardedUnits(ZeroOptimizerShard& shard, ProcessGroup& group, bool parameters_sharded)
      : shard_(shard), group_(group), parameters_sharded_(parameters_sharded) {
    if (parameters_sharded_) {
#ifndef NDEBUG
      throw ConfigurationError("trainloop: sharding is full in a build without NDEBUG; libtorch's headers then assert "
                               "on RecordFunction::inputs(), which full sharding reads; expected a Release or "
                               "RelWithDebInfo build (NDEBUG defined, as libtorch itself is built), or sharding gradients");
#endif
      flatten_parameters();
      ShardedUnits* expected = nullptr;
      TRAINLOOP_CHECK(watching().compare_exchange_strong(expected, this), "two fits with full sharding at once in one "
                      "process; expected one at a time");
      callback_ = at::addGlobalCallback(at::RecordFunctionCallback(&ShardedUnits::on_operator).needsInputs(true));
      callback_enabled_ = true;
      set_callback_enabled(false);  // on only while a micro-batch trains: every operator boxes its inputs for it
    }
    attach_hooks();
  }
  ShardedUnits(const ShardedUnits&) = delete;
  ShardedUnits& operator=(const ShardedUnits&) = delete;
  /// Removes the hooks and the observer. Call release() first: the parameters stay views otherwise.
  ~ShardedUnits() {
    remove_hooks();
    if (parameters_sharded_) {
      at::removeCallback(callback_);
      watching().store(nullptr);
    }
  }

  /// Before a micro-batch's forward: whether it reduces; at level 3, every unit freed (this rank's
  /// chunks first refreshed from the parameters when they were whole) and the observer on.
  void begin_micro_batch(bool synchronize) {
    if (trainable_set_changed()) attach_hooks();
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->synchronize = synchronize;
    }
    if (!parameters_sharded_) return;
    std::lock_guard<std::mutex> lock(units_mutex_);
    if (whole_) shard_.refresh_own_shards();
    whole_ = false;
    for (size_t u = 0; u < full_.size(); ++u) free_unit(u);
    observing_.store(true);
    set_callback_enabled(true);
  }
  /// After a micro-batch's backward (also when it threw): level 3 frees every unit.
  void end_micro_batch() noexcept {
    if (!parameters_sharded_) return;
    observing_.store(false);
    set_callback_enabled(false);
    std::lock_guard<std::mutex> lock(units_mutex_);
    for (size_t u = 0; u < full_.size(); ++u) free_unit(u);
  }
  /// After forward and backward: a gather that failed inside the observer (libtorch's
  /// RecordFunction swallows a callback's exceptions) is thrown here, with its type.
  void rethrow_gather_error() {
    if (gather_error_) std::rethrow_exception(std::exchange(gather_error_, nullptr));
  }
  /// Level 3, after the optimizer stepped this rank's chunks: whatever was gathered before the
  /// step (a callback that evaluated) is stale, so every unit is freed and gathered anew.
  void after_step() noexcept {
    if (!parameters_sharded_) return;
    std::lock_guard<std::mutex> lock(units_mutex_);
    whole_ = false;
    for (size_t u = 0; u < full_.size(); ++u) free_unit(u);
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
  }
  /// Level 3: every unit whole on every rank (a collective), for evaluation or a checkpoint; the
  /// next micro-batch shards them again. A no-op at level 2.
  void unshard() {
    if (!parameters_sharded_) return;
    std::lock_guard<std::mutex> lock(units_mutex_);
    Busy busy(busy_);
    for (size_t u = 0; u < full_.size(); ++u) gather_unit(u);
    whole_ = true;
  }
  /// Level 3, at the end of the fit: each parameter its own tensor again, with its whole values
  /// (`communicate`: gathered, a collective) or, when the fit ended with an exception and the
  /// other ranks may not be listening, the units this rank holds whole and NaN elsewhere.
  void release(bool communicate) {
    if (!parameters_sharded_ || full_.empty()) return;
    observing_.store(false);
    torch::NoGradGuard no_grad;
    bool lost = false;
    if (communicate) {
      unshard();
    } else {
      std::lock_guard<std::mutex> lock(units_mutex_);
      for (size_t u = 0; u < full_.size(); ++u) {
        if (gathered_[u]) continue;
        allocate_unit(u);
        full_[u].fill_(std::numeric_limits<double>::quiet_NaN());
        const int64_t chunk = shard_.unit_chunk(u);  // this rank's own chunk it still has
        full_[u].narrow(0, group_.rank() * chunk, chunk).copy_(shard_.own_shard(u));
        lost = true;
      }
    }
    for (size_t u = 0; u < full_.size(); ++u) {
      for (auto& [parameter, offset] : shard_.unit_tensors(u)) {
        torch::Tensor own = torch::empty_strided(parameter.sizes(), parameter.strides(), parameter.options());
        ::trainloop::distributed::detail::flat_view(own).copy_(::trainloop::distributed::detail::flat_view(parameter));
        parameter.set_data(own);
      }
    }
    full_.clear();
    if (lost) {
      std::cerr << "trainloop: a fit with full sharding ended by an exception; of the units this rank did not hold "
                   "whole, only its own chunk is in its model, the rest NaN (load a checkpoint to continue)\n";
    }
  }

 private:
  /// Marks a gather under way while it lives.
  struct Busy {
    explicit Busy(std::atomic<bool>& flag) : flag(flag) { flag.store(true); }
    ~Busy() { flag.store(false); }
    std::atomic<bool>& flag;
  };

  /// Turns the observer on or off (called from the training thread only).
  void set_callback_enabled(bool enabled) noexcept {
    if (enabled == callback_enabled_) return;
    if (enabled) {
      at::reenableCallback(callback_);
    } else {
      at::disableCallback(callback_);
    }
    callback_enabled_ = enabled;
  }

  static std::atomic<ShardedUnits*>& watching() {
    static std::atomic<ShardedUnits*> units{nullptr};
    return units;
  }

  /// The observer: before an operator reads a view of a freed unit, gathers it (collectives and
  /// copies inside are not observed: one thread-local flag).
  static std::unique_ptr<at::ObserverContext> on_operator(const at::RecordFunction& function) {
    static thread_local bool inside = false;
    ShardedUnits* self = watching().load();
    // busy_: a gather is under way, and Gloo's threads copy into the unit's buffer (not a use).
    if (inside || self == nullptr || !self->observing_.load() || self->busy_.load()) return nullptr;
    inside = true;
    struct Leave {
      ~Leave() { inside = false; }
    } leave;
    std::vector<size_t> touched;
    auto look = [&](const at::Tensor& tensor) {
      if (!tensor.defined() || !tensor.has_storage()) return;
      const void* storage = tensor.storage().unsafeGetStorageImpl();
      for (size_t u = 0; u < self->storages_.size(); ++u) {
        if (self->storages_[u] == storage && std::find(touched.begin(), touched.end(), u) == touched.end()) touched.push_back(u);
      }
    };
    for (const c10::IValue& input : function.inputs()) {
      if (input.isTensor()) {
        look(input.toTensor());
      } else if (input.isList()) {  // Tensor[] and Tensor?[]
        for (const c10::IValue& element : input.toListRef()) {
          if (element.isTensor()) look(element.toTensor());
        }
      }
    }
    if (touched.empty()) return nullptr;
    try {
      self->use_units(touched);
    } catch (...) {
      self->fail_gathers(std::current_exception());
    }
    return nullptr;
  }

  /// A gather failed inside the observer (out of memory, a peer gone): every unit gets memory
  /// (NaN where it holds no values), so the operators about to run read no freed buffer; the
  /// observer stops, and the error is thrown after backward (rethrow_gather_error).
  void fail_gathers(std::exception_ptr error) noexcept {
    observing_.store(false);
    std::lock_guard<std::mutex> lock(units_mutex_);
    if (!gather_error_) gather_error_ = std::move(error);
    for (size_t u = 0; u < full_.size(); ++u) {
      if (gathered_[u]) continue;
      try {
        allocate_unit(u);
        full_[u].fill_(std::numeric_limits<double>::quiet_NaN());
        gathered_[u] = 1;
      } catch (...) {  // no memory even for that: the operator fails on its own
      }
    }
  }

  /// Makes exactly the units `touched` (and those already whole that it reads) whole, in unit order.
  void use_units(std::vector<size_t> touched) {
    std::lock_guard<std::mutex> lock(units_mutex_);
    Busy busy(busy_);
    bool all_whole = true;
    for (size_t u : touched) all_whole = all_whole && gathered_[u];
    if (all_whole) return;
    for (size_t u = 0; u < full_.size(); ++u) {
      if (gathered_[u] && std::find(touched.begin(), touched.end(), u) == touched.end()) free_unit(u);
    }
    std::sort(touched.begin(), touched.end());
    for (size_t u : touched) gather_unit(u);
  }

  /// Moves every unit's parameters into its flat buffer (W chunks of unit_chunk elements) as
  /// views with their own sizes and strides.
  void flatten_parameters() {
    torch::NoGradGuard no_grad;
    const int64_t world = group_.world_size();
    for (size_t u = 0; u < shard_.unit_count(); ++u) {
      auto tensors = shard_.unit_tensors(u);
      torch::Tensor full = torch::zeros({world * shard_.unit_chunk(u)},
                                        tensors.empty() ? torch::TensorOptions() : tensors.front().first.options());
      for (auto& [parameter, offset] : tensors) {
        torch::Tensor view = full.as_strided(parameter.sizes(), parameter.strides(), offset);
        ::trainloop::distributed::detail::flat_view(view).copy_(::trainloop::distributed::detail::flat_view(parameter));
        parameter.set_data(view);
      }
      storages_.push_back(full.storage().unsafeGetStorageImpl());
      full_.push_back(std::move(full));
      gathered_.push_back(1);
    }
    whole_ = true;
  }

  /// Gives unit `u`'s buffer its memory back (uninitialized).
  void allocate_unit(size_t u) {
    c10::StorageImpl* storage = full_[u].storage().unsafeGetStorageImpl();
    const size_t bytes = static_cast<size_t>(full_[u].numel()) * full_[u].element_size();
    if (storage->nbytes() == bytes) return;
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
  }
  /// Unit `u` whole: every rank's chunk into its buffer (an all-gather).
  void gather_unit(size_t u) {
    if (gathered_[u]) return;
    allocate_unit(u);
    group_.all_gather_into(shard_.own_shard(u), full_[u]);
    gathered_[u] = 1;
  }
  /// Frees unit `u`'s buffer: its views keep their sizes and read nothing until gathered again.
  void free_unit(size_t u) noexcept {
    if (!gathered_[u]) return;
    c10::StorageImpl* storage = full_[u].storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(storage->allocator()->allocate(0));
    storage->set_nbytes(0);
    gathered_[u] = 0;
  }

  /// Reduce-scatters unit `u`'s gradients into this rank's chunk (ZeroOptimizerShard::unit_gradient),
  /// releasing the whole local ones as they are copied. Called with the gradient state's mutex held.
  void reduce_unit(size_t u) {
    torch::NoGradGuard no_grad;
    auto tensors = shard_.unit_tensors(u);
    torch::Tensor& chunk = shard_.unit_gradient(u);
    torch::Tensor input = torch::zeros({group_.world_size() * chunk.numel()}, chunk.options());
    for (auto& [parameter, offset] : tensors) {
      const torch::Tensor& grad = parameter.grad();
      if (!grad.defined()) continue;  // unused or frozen: zeros, as the gradient reducer sends
      input.narrow(0, offset, parameter.numel()).copy_(::trainloop::distributed::detail::flat_in_layout_of(grad, parameter));
      // Released as soon as copied: the collective then runs beside one copy of the unit's
      // gradient, not two (64 MiB less at the peak of the 100 M MLP's 64 MiB units).
      parameter.mutable_grad().reset();
    }
    input.mul_(1.0 / group_.world_size());  // the average, scaled before the sum as the gradient reducer does
    const progress::CollectiveLabel label("gradients of unit", static_cast<int>(u), static_cast<int>(shard_.unit_count()));
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
    const size_t units = shard_.unit_count();
    state_->expected.assign(units, 0);
    state_->arrived.assign(units, 0);
    state_->reduced.assign(units, 0);
    for (size_t u = units; u-- > 0;) state_->order.push_back(u);
    state_->reduce = [this](size_t u) { reduce_unit(u); };
    parameters_.clear();
    hooked_flags_.clear();
    for (size_t u = 0; u < units; ++u) {
      for (auto& [parameter, offset] : shard_.unit_tensors(u)) {
        parameters_.push_back(parameter);
        hooked_flags_.push_back(parameter.requires_grad() ? 1 : 0);
        if (!parameter.requires_grad()) continue;
        std::shared_ptr<torch::autograd::Node> accumulator = torch::autograd::impl::grad_accumulator(parameter);
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

  ZeroOptimizerShard& shard_;
  ProcessGroup& group_;
  bool parameters_sharded_ = false;
  std::shared_ptr<detail::UnitGradientState> state_;
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive: autograd holds them weakly
  std::vector<std::uintptr_t> hook_keys_;
  std::vector<torch::Tensor> parameters_;  // every unit's parameters, in layout order
  std::vector<char> hooked_flags_;         // which of them had a hook attached (required grad then)
  // Level 3:
  std::mutex units_mutex_;              // gathers and frees (the observer may run on autograd's threads)
  std::vector<torch::Tensor> full_;     // each unit's flat buffer, W chunks
  std::vector<const void*> storages_;   // their storages, what the observer looks for
  std::vector<char> gathered_;          // whether unit u's buffer holds its whole values now
  bool whole_ = false;                  // every unit whole, perhaps changed since (evaluation, a checkpoint load)
  std::atomic<bool> observing_{false};  // a micro-batch trains: the observer gathers
  std::atomic<bool> busy_{false};       // a gather is under way: operators seen now are its own
  at::CallbackHandle callback_ = 0;
  bool callback_enabled_ = false;       // whether callback_ runs now (training thread only)
  std::exception_ptr gather_error_;     // a gather the observer could not do, thrown after backward
};

}  // namespace trainloop::distributed
