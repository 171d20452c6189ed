#pragma once
/// @file
/// @brief How the ranks' micro-batches of one training epoch line up, and how much each rank's
/// gradient weighs in each: the arithmetic behind exact DDP for uneven last batches
/// (TrainLoopOptions::exact_uneven_batches).
///
/// Positions of the epoch's order are dealt round-robin (data/shard_sampler.hpp), so micro-batch k
/// of every rank together holds exactly positions [k·W·b, (k+1)·W·b) — one process's batch k with
/// batch W·b. Only the last one can be short: R = W·b·q + m remaining positions leave rank r
/// ceil((m - r) / W) samples there, some ranks none at all when m < W. PyTorch pads every shard to
/// ceil(R / W) by repeating samples and averages the ranks' mean gradients with equal weights, so
/// its last step is not the one-process step. Here, with exact weighting, the shards are not
/// padded, every rank runs the same number of micro-batches (a rank without samples in the last
/// one still takes part in the reduction, contributing nothing), and rank r's loss in micro-batch
/// k is multiplied by W·n(r,k) / N(k): after the reducer's mean over W ranks, the gradient is
/// Σ_r n(r,k)/N(k) · ∇mean-loss(r,k) — the gradient of the mean loss over the combined batch.
/// Every rank computes every n(r,k) from the dataset size alone: no collective, nothing measurable
/// per step (one division). With equal batches the factor is exactly 1.0, so results are bit for
/// bit those of equal weighting.

#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/engine/optional_members.hpp>
#include <trainloop/loop/shard_indices.hpp>
#include <trainloop/options.hpp>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace trainloop::detail {

/// One epoch's micro-batches, as every rank sees them (see the file comment).
class EpochBatchPlan {
 public:
  /// @param remaining_samples for each rank, its samples left in the epoch (its shard from the
  ///        resume position on); all equal when shards are padded
  /// @param batch_size samples per micro-batch on each rank
  /// @param drop_last drop the last incomplete batch (exact: the last incomplete *combined* batch,
  ///        as one process with batch W·b would)
  /// @param exact weight ranks by their samples (shards unpadded); false: every rank's batches are
  ///        equal (padded shards) or the mode has one rank
  EpochBatchPlan(std::vector<int64_t> remaining_samples, int64_t batch_size, bool drop_last, bool exact)
      : samples_(std::move(remaining_samples)), batch_(batch_size), exact_(exact) {
    const int64_t own = samples_.empty() ? 0 : *std::max_element(samples_.begin(), samples_.end());
    if (exact_) {
      int64_t total = 0;
      for (int64_t n : samples_) total += n;
      const int64_t combined = batch_ * world();
      batches_ = drop_last ? total / combined : (total + combined - 1) / combined;
    } else {
      batches_ = drop_last ? own / batch_ : (own + batch_ - 1) / batch_;
    }
  }

  /// Micro-batches every rank runs (from the resume position on).
  int64_t batches() const noexcept { return batches_; }

  /// Samples rank `rank` has in micro-batch `k` (0: it takes part without samples).
  int64_t samples(int64_t rank, int64_t k) const {
    return std::clamp<int64_t>(samples_.at(static_cast<size_t>(rank)) - k * batch_, 0, batch_);
  }

  /// The factor on rank `rank`'s loss in micro-batch `k`: W·n(rank,k)/N(k) when exact, else 1.
  double gradient_weight(int64_t rank, int64_t k) const {
    if (!exact_ || world() == 1) return 1.0;
    int64_t combined = 0;
    for (int64_t r = 0; r < world(); ++r) combined += samples(r, k);
    return combined == 0 ? 0.0
                         : static_cast<double>(world() * samples(rank, k)) / static_cast<double>(combined);
  }

  /// Samples of every rank together in micro-batches [0, k): the positions of the epoch's order
  /// they consumed (with padded shards, repeats included, as the sampler deals them).
  int64_t combined_samples_before(int64_t k) const {
    int64_t total = 0;
    for (int64_t r = 0; r < world(); ++r) total += std::clamp<int64_t>(samples_[static_cast<size_t>(r)], 0, k * batch_);
    return total;
  }

  /// Whether the shards are unpadded and ranks weighted by their samples.
  bool exact() const noexcept { return exact_; }

 private:
  int64_t world() const noexcept { return static_cast<int64_t>(samples_.size()); }

  std::vector<int64_t> samples_;
  int64_t batch_;
  bool exact_;
  int64_t batches_ = 0;
};

/// Whether this run trains with exact uneven batches: asked for (the default), several ranks, an
/// engine that can take part without samples, and no SyncBatchNorm (its forward is a collective,
/// so every rank must run every forward: the shards stay padded then).
template <class Engine>
bool exact_uneven_batches(const Engine& engine, const TrainLoopOptions& options) {
  return TrainsWithoutSamples<Engine> && options.exact_uneven_batches() && engine.data_shard().world_size > 1 &&
         !options.sync_batchnorm();
}

/// The plan of (the rest of) one training epoch over a dataset of `dataset_size` samples, from
/// position `start_position` of the epoch's order on; the same on every rank.
inline EpochBatchPlan plan_epoch(size_t dataset_size, const DataShard& shard, const TrainLoopOptions& options,
                                 bool exact, uint64_t seed, uint64_t start_position = 0) {
  std::vector<int64_t> samples;
  for (int64_t rank = 0; rank < shard.world_size; ++rank) {
    samples.push_back(static_cast<int64_t>(
        shard_sampler(dataset_size, DataShard{rank, shard.world_size}, true, options, seed, start_position, !exact)
            .num_samples()));
  }
  return EpochBatchPlan(std::move(samples), options.batch_size(), options.drop_last(), exact);
}

}  // namespace trainloop::detail
