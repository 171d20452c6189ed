#pragma once
/// @file
/// @brief GradientCommHook: how DDP's GradientReducer communicates one full bucket of gradients —
/// the seam for gradient compression (fp16/bf16 casts, PowerSGD) and any user scheme, one class.
///
/// Without a hook the reducer all-reduces (sums) each bucket asynchronously; the bucket holds this
/// rank's gradients already multiplied by 1/world size, so the sum is the mean. A hook replaces that
/// step: launch() starts its communication and returns the work to wait for; once that work has
/// completed, finish() leaves the averaged gradients in the bucket, from which the reducer writes
/// every parameter's grad. Hooks run in bucket order, identically on every rank (from autograd
/// hooks during backward, under the reducer's lock, or from finalize()), so their collectives
/// match across ranks.
///
/// The reducer counts the bytes each rank puts on the wire per step (GradientReducer::
/// last_step_bytes_sent()): a hook says what its launch sends through bytes_sent(), in the ring
/// model every backend uses for large tensors (ring_all_reduce_bytes, ring_all_gather_bytes).

#include <trainloop/distributed/process_group.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
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

/// @brief Communicates one gradient bucket across the ranks (see the file comment).
class GradientCommHook {
 public:
  virtual ~GradientCommHook() = default;
  /// Called once when the hook is attached to a reducer, before any launch(): every bucket's
  /// layout, in bucket (launch) order. The default ignores it.
  virtual void on_buckets_formed(const std::vector<BucketLayout>& /*buckets*/) {}
  /// @brief Starts reducing one bucket across the ranks.
  /// @param group the ranks' process group
  /// @param index the bucket's position in launch order (0 = the first to fill in backward)
  /// @param flat the bucket: this rank's gradients times 1/world size, contiguous, on the group's device
  /// @return the work the reducer waits for before calling finish()
  virtual WorkHandle launch(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) = 0;
  /// @brief After launch()'s work completed: writes the reduced (mean) gradients into the bucket.
  /// @param index the bucket's position, as given to launch()
  /// @param flat the bucket, as given to launch()
  virtual void finish(std::size_t index, const torch::Tensor& flat) = 0;
  /// Bytes this rank sent for the last launch() of bucket `index` (`flat` as given to it). The
  /// default is an all-reduce of `flat` itself; a hook that sends something else says what.
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
