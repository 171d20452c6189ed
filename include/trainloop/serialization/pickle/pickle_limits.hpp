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
///
/// What they add up to (docs/models-and-interop.md states it for a whole file): the values of a
/// pickle of P bytes take at most min(max_value_bytes, value_bytes_floor +
/// value_bytes_per_pickle_byte * P) bytes, because every value is charged at least what it costs
/// when it is made (measured: a tensor 264 B on libtorch 1.13 as made here, charged 512; see
/// PickleBuilder), and the reader's time is linear in P (each opcode does O(1) work, or copies
/// what it pops). test_weight_files' worst_files_stay_within_the_stated_memory_and_time checks it
/// with the worst files known (a view bomb, a memo bomb, deep nesting built top down).
struct PickleLimits {
  /// The pickle's own size: 2,300x resnet152's data.pkl (a model of ~2 million tensors fits).
  size_t max_pickle_bytes = size_t{256} << 20;
  /// Memory the values may take, counted as they are made (texts, containers, tensors, stack,
  /// memo), whatever the pickle's size.
  size_t max_value_bytes = size_t{1} << 30;
  /// ... and at most this much plus value_bytes_per_pickle_byte per byte of the pickle, so a
  /// small file cannot ask for the whole max_value_bytes: a real state_dict's values take 13-20
  /// bytes per pickle byte (resnet152, Llama-2's layout), a crafted one's at most what this allows.
  size_t value_bytes_floor = size_t{16} << 20;
  /// See value_bytes_floor.
  size_t value_bytes_per_pickle_byte = 64;
  /// Containers nested in containers, measured on the finished pickle (whatever order it built
  /// them in, reachable or not): 3 in resnet152's state_dict; a module tree's depth + 4 in a
  /// TorchScript archive. Nothing of trainloop recurses over values, but libtorch's own reader,
  /// which reads a TorchScript archive's pickles after trainloop checked them, does.
  uint32_t max_depth = 256;
  /// MARKs open at once: 3 in a state_dict.
  size_t max_open_marks = 256;
  /// Values on the stack at once: a state_dict's SETITEMS holds 2 per tensor (Python batches 1000).
  size_t max_stack = size_t{1} << 22;
  /// Memo entries, whatever indices the pickle uses: ~9 per tensor.
  size_t max_memo = size_t{1} << 22;
  /// Dimensions of a tensor: libtorch's kernels stop at 25 or fewer.
  size_t max_dims = 64;

  /// The value budget of a pickle of `pickle_bytes` bytes (see the struct's comment).
  size_t value_budget(size_t pickle_bytes) const {
    const size_t per_byte = value_bytes_per_pickle_byte;
    if (per_byte != 0 && pickle_bytes > (max_value_bytes - value_bytes_floor) / per_byte) return max_value_bytes;
    const size_t budget = value_bytes_floor + per_byte * pickle_bytes;
    return budget < max_value_bytes ? budget : max_value_bytes;
  }
};

/// @brief What one pickle used of the limits (for tests, and to restate the limits' reasons).
struct PickleStats {
  size_t pickle_bytes = 0;   ///< its size
  size_t value_bytes = 0;    ///< memory its values took, as charged against PickleLimits::value_budget
  size_t value_budget = 0;   ///< what it could have taken (PickleLimits::value_budget of its size)
  uint32_t depth = 0;        ///< deepest nesting of the finished pickle
  size_t open_marks = 0;     ///< most MARKs open at once
  size_t stack = 0;          ///< most values on the stack at once
  size_t memo = 0;           ///< memo entries at the end
};

}  // namespace trainloop::serialization
