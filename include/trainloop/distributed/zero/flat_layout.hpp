#pragma once
/// @file
/// @brief The flat layout of a model's parameters over W ranks (DeepSpeed's and FSDP's flat
/// partition), the geometry every sharded part reads and none changes: the optimizer's parameters
/// laid end to end in one flat index space (each tensor in its own memory order, a tied tensor
/// once), grouped in *units* (each a contiguous range, cut in W equal chunks of
/// ceil(length / W) elements; rank r owns chunk r of every unit), and the *pieces* of rank r: the
/// parts of tensors that fall in its chunks.
///
/// ZeRO-1 uses one unit, the whole flat space, so every rank holds the state of ceil(N/W)
/// elements or fewer whatever the model (a tensor is split where a range ends). Sharded gradients
/// and parameters (gpu_mode::FullyShardedDataParallel) use a unit per submodule, so a unit's
/// gradients are reduce-scattered straight into its owners' chunks.

#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// @brief The flat layout of an optimizer's parameters over the ranks (this file's comment).
class FlatLayout {
 public:
  /// @brief A contiguous part of one parameter in one rank's chunk of a unit.
  struct Piece {
    size_t distinct = 0;     ///< which parameter (index into distinct())
    size_t unit = 0;         ///< which unit it belongs to
    int64_t in_tensor = 0;   ///< first element, in the parameter's memory order
    int64_t length = 0;      ///< elements
    int64_t flat = 0;        ///< first element in the flat index space
    int64_t in_chunk = 0;    ///< first element in the rank's chunk of its unit
  };

  /// Lays out every parameter of `optimizer` (its param groups in order) over `world_size` ranks.
  /// `unit_of` (TensorImpl address to unit index) groups them in units, each cut separately;
  /// empty: one unit, the whole flat space (ZeRO-1).
  /// @throws trainloop::Error for parameters of several dtypes or devices, or one in no unit.
  FlatLayout(const torch::optim::Optimizer& optimizer, int world_size,
             const std::unordered_map<const void*, int>& unit_of = {})
      : world_size_(world_size) {
    std::unordered_map<const void*, size_t> distinct_index;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        auto [found, added] = distinct_index.emplace(parameter.unsafeGetTensorImpl(), distinct_.size());
        if (added) {
          TRAINLOOP_CHECK(distinct_.empty() || (parameter.scalar_type() == distinct_.front().scalar_type() &&
                                                parameter.device() == distinct_.front().device()),
                          "ZeRO's flat shards need every parameter in one dtype on one device; parameter ",
                          distinct_.size(), " is ", parameter.scalar_type(), " on ", parameter.device(), ", the first ",
                          distinct_.front().scalar_type(), " on ", distinct_.front().device());
          distinct_.push_back(parameter);
        }
        parameters_.push_back(parameter);
        distinct_of_.push_back(found->second);
      }
    }
    lay_out_units(unit_of);
  }

  /// Ranks the layout is cut for.
  int world_size() const { return world_size_; }
  /// Each parameter once, in first-listed order.
  const std::vector<torch::Tensor>& distinct() const { return distinct_; }
  /// Where distinct parameter `d` starts in the flat space.
  int64_t offset(size_t d) const { return offsets_[d]; }
  /// The distinct index of the optimizer's `index`-th listed parameter (over its groups in order).
  size_t distinct_of(size_t index) const { return distinct_of_[index]; }
  /// Units in the layout (1 for ZeRO-1).
  size_t unit_count() const { return units_.size(); }
  /// Elements of unit `u` (its tensors end to end, without padding).
  int64_t unit_length(size_t u) const { return units_[u].length; }
  /// Elements of each rank's chunk of unit `u`: ceil(unit_length / W); the last chunks are padded.
  int64_t unit_chunk(size_t u) const { return units_[u].chunk; }
  /// The parameters of unit `u` (distinct tensors, in layout order) and where each starts in it.
  std::vector<std::pair<torch::Tensor, int64_t>> unit_tensors(size_t u) const {
    std::vector<std::pair<torch::Tensor, int64_t>> tensors;
    for (size_t d : units_[u].members) tensors.emplace_back(distinct_[d], offsets_[d] - units_[u].begin);
    return tensors;
  }
  /// Rank `r`'s range of unit `u` in the flat space: [begin, end).
  std::pair<int64_t, int64_t> range_of(size_t u, int r) const {
    const Unit& unit = units_[u];
    const int64_t begin = unit.begin + std::min(unit.length, static_cast<int64_t>(r) * unit.chunk);
    return {begin, std::min(unit.begin + unit.length, begin + unit.chunk)};
  }
  /// Elements of the flat space rank `r` owns (its share of the optimizer state).
  int64_t owned_elements(int r) const {
    int64_t owned = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      const auto [begin, end] = range_of(u, r);
      owned += end - begin;
    }
    return owned;
  }
  /// Rank `r`'s pieces, in flat order: at most one per tensor (a unit's range is contiguous).
  std::vector<Piece> pieces_of(int r) const {
    std::vector<Piece> pieces;
    for (size_t u = 0; u < units_.size(); ++u) {
      const auto [begin, end] = range_of(u, r);
      for_each_overlap(begin, end, [&](size_t d, int64_t in_tensor, int64_t flat, int64_t length) {
        pieces.push_back(Piece{d, u, in_tensor, length, flat, flat - begin});
      });
    }
    return pieces;
  }
  /// Calls f(distinct, first element in it, flat start, length) for each parameter overlapping
  /// the flat range [begin, end).
  template <class F>
  void for_each_overlap(int64_t begin, int64_t end, F&& f) const {
    for (size_t d = 0; d < distinct_.size(); ++d) {
      const int64_t lo = std::max(begin, offsets_[d]), hi = std::min(end, offsets_[d] + distinct_[d].numel());
      if (lo < hi) f(d, lo - offsets_[d], lo, hi - lo);
    }
  }

  /// Whether `optimizer` holds the parameters the layout was made for, in the same order.
  bool same_parameters(const torch::optim::Optimizer& optimizer) const {
    size_t index = 0;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        if (index >= parameters_.size() || !parameter.is_same(parameters_[index])) return false;
        ++index;
      }
    }
    return index == parameters_.size();
  }
  /// @throws trainloop::Error when `optimizer` no longer holds the parameters the layout was made for.
  void check_same_parameters(const torch::optim::Optimizer& optimizer) const {
    TRAINLOOP_CHECK(same_parameters(optimizer), "the optimizer's parameters changed since ZeRO laid them out (",
                    parameters_.size(), " then); expected the parameter groups the fit began with");
  }

 private:
  /// Groups the distinct tensors in units (all in unit 0 when `unit_of` is empty), in unit order
  /// and each unit's tensors in first-listed order, and places them in the flat space.
  void lay_out_units(const std::unordered_map<const void*, int>& unit_of) {
    int count = 1;
    std::vector<int> unit_index(distinct_.size(), 0);
    for (size_t d = 0; d < distinct_.size() && !unit_of.empty(); ++d) {
      auto found = unit_of.find(distinct_[d].unsafeGetTensorImpl());
      TRAINLOOP_CHECK(found != unit_of.end(), "parameter ", d, " of the optimizer (sizes ", distinct_[d].sizes(),
                      ") is in no unit of the model; expected the optimizer to hold only the model's parameters");
      unit_index[d] = found->second;
      count = std::max(count, found->second + 1);
    }
    units_.assign(static_cast<size_t>(count), Unit{});
    offsets_.assign(distinct_.size(), 0);
    int64_t total = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      units_[u].begin = total;
      for (size_t d = 0; d < distinct_.size(); ++d) {
        if (unit_index[d] != static_cast<int>(u)) continue;
        offsets_[d] = total;
        total += distinct_[d].numel();
        units_[u].members.push_back(d);
      }
      units_[u].length = total - units_[u].begin;
      units_[u].chunk = (units_[u].length + world_size_ - 1) / std::max(world_size_, 1);
    }
  }

  struct Unit {
    int64_t begin = 0, length = 0, chunk = 0;  // flat start, elements, elements per rank: ceil(length / W)
    std::vector<size_t> members;               // distinct indices, in layout order
  };
  int world_size_ = 1;
  std::vector<torch::Tensor> parameters_;  // param groups in order, a tied tensor as often as listed
  std::vector<size_t> distinct_of_;        // parameters_[i] is distinct_[distinct_of_[i]]
  std::vector<torch::Tensor> distinct_;    // each tensor once, in first-listed order
  std::vector<int64_t> offsets_;           // distinct_[d] starts at offsets_[d] in the flat space
  std::vector<Unit> units_;                // the flat space, unit after unit
};

}  // namespace trainloop::distributed
