#pragma once
/// @file
/// @brief Sharded parameters (ZeRO-3, FSDP's FULL_SHARD): every unit's parameters become views of
/// one flat buffer per unit (W chunks), whose memory is *freed* while the unit is not in use;
/// this rank's own chunk of it (the engine's tensors, which the optimizer's pieces view and which
/// outlive a fit: the optimizer state is keyed by those views) is the only copy between uses.
///
/// A micro-batch trains inside a gather mode (distributed/zero/unit_gather_mode.hpp): before an
/// operator reads a view of a freed unit, the unit is all-gathered (and the units gathered before
/// it are freed). That covers the forward and, because autograd's saved tensors share the freed
/// storage, the backward too. At most the units one operator reads are whole at a time (one, for
/// a model whose operators each read one unit). A gathered unit borrows one of two slots, buffers
/// of the largest unit's size kept for the fit: gathering into fresh memory cost a page fault per
/// 4 KiB, and the kernel's zeroing of those pages was the largest part of what full sharding added
/// to a step (benchmarks/README.md, zero_memory). After the micro-batch all units are freed, and
/// before the optimizer step the slots too.
/// Evaluation and prediction inside a fit run the same way, without gradients: the engine's
/// eval_batch is a micro-batch without backward, so at most the units one operator reads are whole
/// (the loop keeps every rank's batch count equal: the gathers are collectives). A checkpoint, a
/// callback that asks for the whole model (TrainState::gather_whole_weights) and the end of the fit
/// ask for every unit whole (unshard(), a collective every rank calls), into memory of their own;
/// reshard() frees them again, keeping what a callback changed in them.
///
/// Every rank must run the same operators on the same parameters in the same order (the same
/// model, no per-rank choice of layers or experts): the gathers are collectives.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/distributed/zero/unit_gather_mode.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>

#include <c10/core/DeviceGuard.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// @brief What full sharding held whole in this process, for tests and benchmarks: how often every
/// unit was gathered at once (UnitParameters::unshard that gathered something) and the most unit
/// bytes whole at once while units were gathered one operator at a time (use_units).
struct UnitGatherStats {
  int64_t whole_model_gathers = 0;   ///< unshard() calls that gathered at least one unit
  int64_t peak_unit_bytes_whole = 0; ///< the most bytes of units whole at once inside use_units
};
/// This process's UnitGatherStats (every sharded fit of the process adds to it; reset it by assigning {}).
inline UnitGatherStats& unit_gather_stats() {
  static UnitGatherStats stats;
  return stats;
}

/// @brief The sharded parameters of one fit (this file's comment).
class UnitParameters final : public UnitUser {
 public:
  /// Moves each unit's parameters into its flat buffer as views with their own sizes and
  /// strides, and copies this rank's chunk of each into `own_chunks` (one tensor per unit, of
  /// unit_chunk elements). The parameters must be whole and the same on every rank; they stay
  /// whole until the first micro-batch.
  UnitParameters(std::shared_ptr<const FlatLayout> layout, ProcessGroup& group, std::vector<torch::Tensor> own_chunks)
      : layout_(std::move(layout)), group_(group), own_chunks_(std::move(own_chunks)) {
    TRAINLOOP_CHECK(own_chunks_.size() == layout_->unit_count(), "full sharding was given ", own_chunks_.size(),
                    " chunks for ", layout_->unit_count(), " units; expected one per unit");
    torch::NoGradGuard no_grad;
    const int64_t world = group_.world_size();
    for (size_t u = 0; u < layout_->unit_count(); ++u) {
      auto tensors = layout_->unit_tensors(u);
      const torch::TensorOptions options = tensors.empty() ? torch::TensorOptions() : tensors.front().first.options();
      torch::Tensor full = torch::zeros({world * layout_->unit_chunk(u)}, options);
      for (auto& [parameter, offset] : tensors) {
        torch::Tensor view = full.as_strided(parameter.sizes(), parameter.strides(), offset);
        detail::flat_view(view).copy_(detail::flat_view(parameter));
        parameter.set_data(view);
      }
      storages_.push_back(full.storage().unsafeGetStorageImpl());
      own_chunks_[u].copy_(full.narrow(0, group_.rank() * layout_->unit_chunk(u), layout_->unit_chunk(u)));
      full_.push_back(std::move(full));
      holder_.push_back(Holder::Own);
      slot_bytes_ = std::max(slot_bytes_, static_cast<size_t>(full_.back().numel()) * full_.back().element_size());
    }
    whole_ = true;
  }
  UnitParameters(const UnitParameters&) = delete;
  UnitParameters& operator=(const UnitParameters&) = delete;
  /// Frees every unit first: no storage may point into a slot that goes with this object (call
  /// release() before, or the parameters stay views of freed buffers).
  ~UnitParameters() override { free_all(); }

  /// Before a micro-batch's forward: this rank's chunks refreshed from the parameters when they
  /// were whole (evaluation, a loaded checkpoint), and every unit freed. The caller then trains
  /// inside a UnitGatherScope.
  void begin_micro_batch() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (whole_) refresh_own_chunks();
    whole_ = false;
    for (size_t u = 0; u < full_.size(); ++u) free_unit(u);
  }
  /// After a micro-batch's backward (also when it threw): every unit freed (release_slots()
  /// does it too, before the optimizer step: whatever was gathered before the step is stale after it).
  void free_all() noexcept {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    whole_ = false;
    for (size_t u = 0; u < full_.size(); ++u) free_unit(u);
  }
  /// Before the optimizer step: every unit freed and the slots' memory returned, so the step's
  /// temporaries do not sit beside a unit's worth of buffer (the next micro-batch makes them anew).
  void release_slots() noexcept {
    free_all();
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    slots_.clear();
  }
  /// Every unit whole on every rank (a collective), for evaluation or a checkpoint; the next
  /// micro-batch shards them again.
  void unshard() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (whole_) return;
    for (size_t u = 0; u < full_.size(); ++u) {
      if (holder_[u] == Holder::Slot) free_unit(u);  // slots are for the training steps
    }
    slots_.clear();  // idle now: their memory would sit beside the whole model
    bool gathered = false;
    for (size_t u = 0; u < full_.size(); ++u) {
      gathered = gathered || holder_[u] == Holder::Freed;
      gather_unit(u, /*into_slot=*/false);
    }
    if (gathered) ++unit_gather_stats().whole_model_gathers;
    whole_ = true;
  }
  /// Undoes unshard() without a collective: this rank's chunks taken from the whole units (so what
  /// a callback changed in them stays; every rank must have changed the same), then every unit
  /// freed. Nothing when the units are not whole.
  void reshard() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (!whole_) return;
    refresh_own_chunks();
    free_all();
  }
  /// This rank's chunks made current from the whole units when they are whole (what a callback
  /// changed in them kept), leaving them whole: a per-rank checkpoint written inside a callback's
  /// whole-weights scope reads the chunks while the callback still reads the units.
  void sync_own_chunks() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (whole_) refresh_own_chunks();
  }
  /// Copies of this rank's chunk of every unit (current also while the units are whole), in unit order.
  std::vector<torch::Tensor> own_chunk_copies() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    if (whole_) refresh_own_chunks();
    std::vector<torch::Tensor> copies;
    for (const auto& chunk : own_chunks_) copies.push_back(chunk.detach().clone());
    return copies;
  }
  /// Puts chunks own_chunk_copies() returned (on this rank, with this layout) back as this rank's
  /// chunks, and frees every unit (whole ones hold the values replaced). No collective: every rank
  /// puts back its own chunks of the same moment, or the model is a mix.
  void load_own_chunks(const std::vector<torch::Tensor>& chunks) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    TRAINLOOP_CHECK(chunks.size() == own_chunks_.size(), "full sharding was given ", chunks.size(),
                    " chunks to put back for ", own_chunks_.size(), " units; expected one per unit");
    for (size_t u = 0; u < chunks.size(); ++u) {
      TRAINLOOP_CHECK(chunks[u].numel() == own_chunks_[u].numel(), "the chunk of unit ", u, " put back has ",
                      chunks[u].numel(), " elements; expected ", own_chunks_[u].numel(),
                      " (this rank's chunk of the same model and world size)");
    }
    torch::NoGradGuard no_grad;
    free_all();  // whole_ false: the whole units' values are the ones replaced
    for (size_t u = 0; u < chunks.size(); ++u) own_chunks_[u].copy_(chunks[u]);
  }
  /// At the end of the fit: each parameter its own tensor again, with its whole values
  /// (`communicate`: gathered, a collective) or, when the fit ended with an exception and the
  /// other ranks may not be listening, the units this rank holds whole and NaN elsewhere (said
  /// on stderr when `say_lost`; elastic training's survivors load the hand-off next).
  void release(bool communicate, bool say_lost = true) {
    if (full_.empty()) return;
    torch::NoGradGuard no_grad;
    bool lost = false;
    if (communicate) {
      unshard();
    } else {
      std::lock_guard<std::recursive_mutex> lock(mutex_);
      for (size_t u = 0; u < full_.size(); ++u) {
        if (holder_[u] == Holder::Own) continue;
        free_unit(u);
        allocate_own(u);
        full_[u].fill_(std::numeric_limits<double>::quiet_NaN());
        const int64_t chunk = layout_->unit_chunk(u);
        full_[u].narrow(0, group_.rank() * chunk, chunk).copy_(own_chunks_[u]);
        lost = true;
      }
    }
    for (size_t u = 0; u < full_.size(); ++u) {
      for (auto& [parameter, offset] : layout_->unit_tensors(u)) {
        torch::Tensor own = torch::empty_strided(parameter.sizes(), parameter.strides(), parameter.options());
        detail::flat_view(own).copy_(detail::flat_view(parameter));
        parameter.set_data(own);
      }
    }
    full_.clear();
    storages_.clear();
    if (lost && say_lost) {
      std::cerr << "trainloop: a fit with full sharding ended by an exception; of the units this rank did not hold "
                   "whole, only its own chunk is in its model, the rest NaN (load a checkpoint to continue)\n";
    }
  }

  // ---- UnitUser: what the gather mode calls ----
  int unit_of_storage(const c10::StorageImpl* storage) const override {
    for (size_t u = 0; u < storages_.size(); ++u) {
      if (storages_[u] == storage) return static_cast<int>(u);
    }
    return -1;
  }
  /// Makes exactly the units `touched` (and those already whole that it reads) whole, in unit
  /// order, freeing the others. A failed gather throws (through the operator that needed the
  /// unit); the unit stays freed and this rank's chunks unchanged.
  void use_units(std::vector<size_t> touched) override {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    bool all_whole = true;
    for (size_t u : touched) all_whole = all_whole && holder_[u] != Holder::Freed;
    if (all_whole) return;
    for (size_t u = 0; u < full_.size(); ++u) {
      if (holder_[u] != Holder::Freed && std::find(touched.begin(), touched.end(), u) == touched.end()) free_unit(u);
    }
    std::sort(touched.begin(), touched.end());
    for (size_t u : touched) gather_unit(u, /*into_slot=*/true);
    int64_t bytes = 0;
    for (size_t u = 0; u < full_.size(); ++u) {
      if (holder_[u] != Holder::Freed) bytes += full_[u].numel() * static_cast<int64_t>(full_[u].element_size());
    }
    UnitGatherStats& stats = unit_gather_stats();
    stats.peak_unit_bytes_whole = std::max(stats.peak_unit_bytes_whole, bytes);
  }

 private:
  /// Where a unit's values are: nowhere (freed), in a slot, or in memory of its own.
  enum class Holder { Freed, Slot, Own };

  /// Copies this rank's chunk of every unit from the whole parameters.
  void refresh_own_chunks() {
    torch::NoGradGuard no_grad;
    for (size_t u = 0; u < full_.size(); ++u) {
      const int64_t chunk = layout_->unit_chunk(u);
      own_chunks_[u].copy_(full_[u].narrow(0, group_.rank() * chunk, chunk));
    }
  }
  /// Gives unit `u`'s buffer memory of its own (uninitialized).
  void allocate_own(size_t u) {
    const c10::OptionalDeviceGuard on_its_device(full_[u].device());  // a CUDA allocator allocates on the current device
    c10::StorageImpl* storage = storages_[u];
    const size_t bytes = static_cast<size_t>(full_[u].numel()) * full_[u].element_size();
    storage->set_data_ptr_noswap(storage->allocator()->allocate(bytes));
    storage->set_nbytes(bytes);
    holder_[u] = Holder::Own;
  }
  /// Points unit `u`'s buffer at a free slot (made on first use), or at memory of its own when
  /// both slots hold units an operator reads together.
  void borrow_slot(size_t u) {
    for (Slot& slot : slots_) {
      if (slot.unit >= 0) continue;
      c10::StorageImpl* storage = storages_[u];
      storage->set_data_ptr_noswap(c10::DataPtr(slot.memory.data_ptr(), slot.memory.device()));  // not owning
      storage->set_nbytes(static_cast<size_t>(full_[u].numel()) * full_[u].element_size());
      slot.unit = static_cast<int>(u);
      holder_[u] = Holder::Slot;
      return;
    }
    if (slots_.size() < 2) {
      slots_.push_back(Slot{torch::empty({static_cast<int64_t>(slot_bytes_)}, full_[u].options().dtype(torch::kUInt8)), -1});
      borrow_slot(u);
      return;
    }
    allocate_own(u);
  }
  /// Unit `u` whole: every rank's chunk into its buffer (an all-gather).
  void gather_unit(size_t u, bool into_slot) {
    if (holder_[u] != Holder::Freed) return;
    if (into_slot) {
      borrow_slot(u);
    } else {
      allocate_own(u);
    }
    try {
      const progress::CollectiveLabel label("parameters of unit", static_cast<int>(u), static_cast<int>(full_.size()));
      if (group_.backend() == Backend::Gloo) {
        // Gloo's allgather flattens into a fresh buffer of the whole unit and copies out of it: a
        // page fault per 4 KiB of new memory and a copy, per gather. Each owner's broadcast lands
        // in place in the unit's buffer instead (as ZeroOptimizerShard::broadcast_pieces does).
        const int64_t chunk = layout_->unit_chunk(u);
        full_[u].narrow(0, group_.rank() * chunk, chunk).copy_(own_chunks_[u]);
        for (int r = 0; r < group_.world_size(); ++r) group_.broadcast(full_[u].narrow(0, r * chunk, chunk), r);
      } else {
        group_.all_gather_into(own_chunks_[u], full_[u]);  // one collective (c10d may stage it; not measured on a GPU)
      }
    } catch (...) {
      free_unit(u);  // nothing reads half-gathered values
      throw;
    }
  }
  /// Frees unit `u`'s buffer: its views keep their sizes and read nothing until gathered again.
  void free_unit(size_t u) noexcept {
    if (holder_[u] == Holder::Freed) return;
    for (Slot& slot : slots_) {
      if (slot.unit == static_cast<int>(u)) slot.unit = -1;
    }
    const c10::OptionalDeviceGuard on_its_device(full_[u].device());
    c10::StorageImpl* storage = storages_[u];
    storage->set_data_ptr_noswap(storage->allocator()->allocate(0));
    storage->set_nbytes(0);
    holder_[u] = Holder::Freed;
  }

  /// A buffer of the largest unit's size that one gathered unit at a time borrows.
  struct Slot {
    torch::Tensor memory;  ///< bytes
    int unit = -1;         ///< the unit in it, -1 when free
  };

  std::shared_ptr<const FlatLayout> layout_;
  ProcessGroup& group_;
  std::vector<torch::Tensor> own_chunks_;    // this rank's chunk of each unit (the engine's): the only copy between uses
  std::recursive_mutex mutex_;               // gathers and frees (the gather mode may run on autograd's threads)
  std::vector<torch::Tensor> full_;          // each unit's flat buffer, W chunks
  std::vector<c10::StorageImpl*> storages_;  // their storages, what the gather mode looks for
  std::vector<Holder> holder_;               // where each unit's values are now
  std::vector<Slot> slots_;                  // at most two, made on first use
  size_t slot_bytes_ = 0;                    // the largest unit's bytes
  bool whole_ = false;                       // every unit whole, perhaps changed since (evaluation, a checkpoint load)
};

}  // namespace trainloop::distributed
