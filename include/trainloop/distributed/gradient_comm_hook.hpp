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

#include <trainloop/distributed/process_group.hpp>

#include <torch/torch.h>

#include <cstddef>

namespace trainloop::distributed {

/// @brief Communicates one gradient bucket across the ranks (see the file comment).
class GradientCommHook {
 public:
  virtual ~GradientCommHook() = default;
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
};

}  // namespace trainloop::distributed
