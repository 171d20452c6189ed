#pragma once
/// @file
/// @brief The bounds the unpickler holds every pickle to, and what it measured of one pickle.
///
/// Each bound is far above what real files need, so no real state_dict meets one, and low
/// enough that no crafted file gets more memory or stack than a few hundred MiB. Measured with
/// this reader (test_weight_files' real_state_dicts_stay_far_below_the_limits prints them, from
/// files Python's torch.save writes): torchvision's resnet152 state_dict (932 tensors) has a
/// 115,291-byte data.pkl whose values take 1.6 MB, nesting 3, 3 open MARKs, 1,872 values on the
/// stack and 8,003 memo entries; Llama-2-7B's layout (323 tensors) 36,222 bytes, 0.4 MB, 2, 3, 654
/// and 2,268. The test asserts every figure is at least 10x (nesting, MARKs) to 1000x (size)
/// below its limit.

#include <cstddef>
#include <cstdint>

namespace trainloop::serialization {

/// @brief Bounds of one pickle; exceeding any is a PickleError naming it.
struct PickleLimits {
  /// The pickle's own size: 2,300x resnet152's data.pkl (a model of ~2 million tensors fits).
  size_t max_pickle_bytes = size_t{256} << 20;
  /// Memory the values may take, counted as they are made (texts, containers, stack, memo):
  /// a real state_dict takes a few times its pickle's size.
  size_t max_value_bytes = size_t{1} << 30;
  /// Containers nested in containers, as built: 3 in resnet152's state_dict; a module tree's
  /// depth + 4 in a TorchScript archive. (Nothing here recurses over values, so depth is bounded to refuse
  /// nonsense early, not to protect a stack.)
  uint32_t max_depth = 256;
  /// MARKs open at once: 3 in a state_dict.
  size_t max_open_marks = 256;
  /// Values on the stack at once: a state_dict's SETITEMS holds 2 per tensor (Python batches 1000).
  size_t max_stack = size_t{1} << 22;
  /// Memo entries, whatever indices the pickle uses: ~9 per tensor.
  size_t max_memo = size_t{1} << 22;
  /// Dimensions of a tensor: libtorch's kernels stop at 25 or fewer.
  size_t max_dims = 64;
};

/// @brief What one pickle used of the limits (for tests, and to restate the limits' reasons).
struct PickleStats {
  size_t pickle_bytes = 0;   ///< its size
  size_t value_bytes = 0;    ///< memory its values took, counted as PickleLimits::max_value_bytes
  uint32_t depth = 0;        ///< deepest nesting built
  size_t open_marks = 0;     ///< most MARKs open at once
  size_t stack = 0;          ///< most values on the stack at once
  size_t memo = 0;           ///< memo entries at the end
};

}  // namespace trainloop::serialization
