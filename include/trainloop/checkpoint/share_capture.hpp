#pragma once
/// @file
/// @brief A rank's part of a per-rank checkpoint captured into host buffers it reuses, so the
/// file can be written behind training (checkpoint/background_write.hpp) while the training
/// thread goes on with the next step.
///
/// plan() runs on the training thread at the checkpoint's step: it cuts every share into the
/// boxes DCP stores (the same boxes, in the same order, as write_rank_file writes from the live
/// tensors, so the file is the same byte for byte), gives each its buffer — the previous
/// checkpoint's when the sizes match, so a job's checkpoints reuse one set of buffers — and copies
/// at once what the next forward changes (the model's buffers: BatchNorm's statistics). copy()
/// then copies the rest, on any thread, until the next optimizer step changes it: the caller
/// (the loop) makes that step wait for copy() to end.
///
/// Copies between CPU tensors are one memcpy per box: no intra-op thread team is started from the
/// writer's thread while the training thread runs its own.

#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/serialization/dcp/flat_range_boxes.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// @brief One box of a per-rank checkpoint: where its elements come from and the buffer they go to.
struct CapturedBox {
  std::string key;               ///< the tensor's key ("model.fc.weight")
  std::vector<int64_t> offsets;  ///< the box's corner in the whole tensor
  std::vector<int64_t> size;     ///< the whole tensor's sizes
  torch::Tensor source;          ///< the live elements, in the box's sizes (a view); undefined once copied
  torch::Tensor buffer;          ///< contiguous host memory of the box's sizes: what is written
  bool copied = false;           ///< copied already (at plan(): what the next forward changes)
};

/// @brief Host copies of this rank's boxes of a per-rank checkpoint (see the file comment).
class ShareCapture {
 public:
  /// Cuts `shares` and the tensors written `whole` (rank 0: what no rank shards; `volatile_whole`
  /// are copied now, the model's buffers) into boxes with their buffers. Training thread.
  /// `one_block`: every buffer is a row-major view into one byte block (block()), which travels
  /// to another rank as one message (elastic training's neighbour copies). `block_for(bytes)`,
  /// when given, makes that block of CPU sources (a file's mapping that outlives the process:
  /// elastic/shared_copy_file.hpp); an undefined tensor from it leaves the block in ordinary memory.
  void plan(const std::vector<TensorShare>& shares, const std::vector<std::pair<std::string, torch::Tensor>>& whole,
            const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole, bool one_block = false,
            const std::function<torch::Tensor(int64_t)>& block_for = {}) {
    if (one_block) return plan_in_one_block(shares, whole, volatile_whole, block_for);
    std::vector<torch::Tensor> spare;
    for (CapturedBox& box : boxes_) spare.push_back(std::move(box.buffer));
    const std::vector<bool> spare_pinned = std::move(pinned_);
    pinned_.clear();
    cut_boxes(shares, whole, volatile_whole);
    for (size_t i = 0; i < boxes_.size(); ++i) {
      CapturedBox& box = boxes_[i];
      // Page-locked for a copy from a device (asked of no accelerator for a CPU source).
      const bool pinned = !box.source.device().is_cpu();
      const torch::Tensor old = i < spare.size() ? spare[i] : torch::Tensor();
      const bool fits = old.defined() && old.scalar_type() == box.source.scalar_type() &&
                        old.sizes() == box.source.sizes() && spare_pinned[i] == pinned;
      // A contiguous source keeps its strides (size-1 dimensions may have any): the foreground
      // write pickles it as it is, and so the file is the same.
      const torch::TensorOptions options = torch::TensorOptions().dtype(box.source.scalar_type()).pinned_memory(pinned);
      const std::vector<int64_t> strides = box.source.is_contiguous() ? box.source.strides().vec() : row_major_strides(box.source.sizes());
      box.buffer = fits && old.strides() == c10::IntArrayRef(strides) ? old : torch::empty_strided(box.source.sizes(), strides, options);
      pinned_.push_back(pinned);
    }
    for (size_t i = boxes_.size() - volatile_whole_boxes_; i < boxes_.size(); ++i) copy_box(boxes_[i]);
  }

  /// Copies every box not copied yet; stops early (returns false) when `cancelled` is set.
  /// Any thread, once per plan().
  bool copy(const std::atomic<bool>& cancelled) {
    for (CapturedBox& box : boxes_) {
      if (cancelled.load()) return false;
      if (!box.copied) copy_box(box);
    }
    return true;
  }

  /// The boxes, in the order they are written.
  const std::vector<CapturedBox>& boxes() const { return boxes_; }
  /// The byte block every buffer is a view into (plan()'s `one_block`), else undefined.
  const torch::Tensor& block() const { return block_; }
  /// Bytes of host memory the buffers hold (one rank's part of a checkpoint).
  int64_t buffer_bytes() const {
    int64_t bytes = 0;
    for (const CapturedBox& box : boxes_) bytes += static_cast<int64_t>(box.buffer.nbytes());
    return bytes;
  }

 private:
  /// plan() with every buffer carved out of one block (reused when the total size is the same),
  /// each box 64-byte aligned.
  void plan_in_one_block(const std::vector<TensorShare>& shares, const std::vector<std::pair<std::string, torch::Tensor>>& whole,
                         const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole,
                         const std::function<torch::Tensor(int64_t)>& block_for) {
    pinned_.clear();
    cut_boxes(shares, whole, volatile_whole);
    std::vector<int64_t> at;
    int64_t total = 0;
    bool pinned = false;
    for (const CapturedBox& box : boxes_) {
      at.push_back(total);
      total += (box.source.numel() * static_cast<int64_t>(box.source.element_size()) + 63) / 64 * 64;
      pinned = pinned || !box.source.device().is_cpu();
    }
    if (!block_.defined() || block_.numel() != total || block_.is_pinned() != pinned) {
      // Page-locked memory for a device's sources comes from the accelerator's allocator only.
      block_ = block_for && !pinned ? block_for(total) : torch::Tensor();
      if (!block_.defined()) block_ = torch::empty({total}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(pinned));
    }
    for (size_t i = 0; i < boxes_.size(); ++i) {
      CapturedBox& box = boxes_[i];
      const int64_t bytes = box.source.numel() * static_cast<int64_t>(box.source.element_size());
      box.buffer = block_.narrow(0, at[i], bytes).view(box.source.scalar_type()).view(box.source.sizes());
      pinned_.push_back(pinned);
    }
    for (size_t i = boxes_.size() - volatile_whole_boxes_; i < boxes_.size(); ++i) copy_box(boxes_[i]);
  }

  /// The boxes of `shares`, then of `whole` and `volatile_whole` (their sources; no buffers yet).
  void cut_boxes(const std::vector<TensorShare>& shares, const std::vector<std::pair<std::string, torch::Tensor>>& whole,
                 const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole) {
    boxes_.clear();
    for (const TensorShare& share : shares) add_share(share);
    for (const auto& [key, tensor] : whole) add_whole(key, tensor);
    for (const auto& [key, tensor] : volatile_whole) add_whole(key, tensor);
    volatile_whole_boxes_ = volatile_whole.size();
  }

  void add_share(const TensorShare& share) {
    const torch::Tensor values = share.values.detach();
    if (share.size.empty()) {  // a 0-d step counter
      boxes_.push_back({share.key, {}, {}, values.reshape({}), {}, false});
      return;
    }
    const size_t dims = share.size.size();
    if (values.numel() == 0) {
      // A tensor without elements still has its entry and one empty box, as Python writes it
      // (DistcpWriter::add_flat_range).
      int64_t whole = 1;
      for (int64_t extent : share.size) whole *= extent;
      if (whole == 0 && share.begin == 0) boxes_.push_back({share.key, std::vector<int64_t>(dims, 0), share.size, values.view(share.size), {}, false});
      return;
    }
    // A run in another memory order (channels_last): the permuted tensor's boxes, each permuted
    // back (as add_run_in_memory_order writes them).
    std::vector<int64_t> order = share.memory_order, permuted(dims), inverse(dims);
    if (order.empty()) {
      for (size_t i = 0; i < dims; ++i) order.push_back(static_cast<int64_t>(i));
    }
    for (size_t i = 0; i < dims; ++i) {
      permuted[i] = share.size[static_cast<size_t>(order[i])];
      inverse[static_cast<size_t>(order[i])] = static_cast<int64_t>(i);
    }
    int64_t at = 0;
    for (const auto& [offsets, sizes] : serialization::dcp::flat_range_boxes(permuted, share.begin, share.begin + values.numel())) {
      int64_t count = 1;
      for (int64_t extent : sizes) count *= extent;
      std::vector<int64_t> box_offsets(dims);
      for (size_t i = 0; i < dims; ++i) box_offsets[static_cast<size_t>(order[i])] = offsets[i];
      boxes_.push_back({share.key, std::move(box_offsets), share.size, values.narrow(0, at, count).view(sizes).permute(inverse),
                        {}, false});
      at += count;
    }
  }
  void add_whole(const std::string& key, const torch::Tensor& tensor) {
    const torch::Tensor values = tensor.detach();
    boxes_.push_back({key, std::vector<int64_t>(static_cast<size_t>(values.dim()), 0), values.sizes().vec(), values, {}, false});
  }
  static std::vector<int64_t> row_major_strides(c10::IntArrayRef sizes) {
    std::vector<int64_t> strides(sizes.size());
    int64_t stride = 1;
    for (size_t d = sizes.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= std::max<int64_t>(sizes[d], 1);
    }
    return strides;
  }
  static void copy_box(CapturedBox& box) {
    const torch::Tensor& from = box.source;
    if (from.device().is_cpu() && from.is_contiguous() && box.buffer.is_contiguous()) {
      if (from.numel() > 0) std::memcpy(box.buffer.data_ptr(), from.data_ptr(), from.nbytes());
    } else {
      box.buffer.copy_(from);  // another device, or another memory order: libtorch's copy
    }
    box.copied = true;
    box.source = torch::Tensor();  // holds no live tensor past its copy (a state replaced later is freed)
  }

  std::vector<CapturedBox> boxes_;
  std::vector<bool> pinned_;  // per box: its buffer is page-locked
  torch::Tensor block_;       // plan()'s one_block: what every buffer views
  size_t volatile_whole_boxes_ = 0;
};

}  // namespace trainloop::detail
