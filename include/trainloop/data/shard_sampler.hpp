#pragma once
/// @file
/// @brief `trainloop::data::ShardSampler`: which sample indices one rank visits in one epoch.
///
/// Pure index arithmetic, no collectives: every rank builds the same epoch permutation from
/// `seed + epoch` and takes every `world_size`-th position starting at its rank, as PyTorch's
/// DistributedSampler does. Unlike libtorch's DistributedRandomSampler inside
/// make_data_loader, `set_epoch` is reachable, so the order changes every epoch.

#include <trainloop/error.hpp>

#include <torch/arg.h>

#include <range/v3/range/conversion.hpp>
#include <range/v3/view/iota.hpp>
#include <range/v3/view/stride.hpp>
#include <range/v3/view/transform.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief Options of ShardSampler. Defaults are PyTorch DistributedSampler's (a training
/// sampler): shuffled, padded to equal shards, partial tail kept.
struct ShardSamplerOptions {
  /// Visit samples in a per-epoch random order (same on every rank) instead of 0..N-1.
  TORCH_ARG(bool, shuffle) = true;
  /// Base seed; the permutation of epoch e is drawn from seed + e.
  TORCH_ARG(uint64_t, seed) = 0;
  /// Training: pad by repeating samples from the start of the order so every rank gets
  /// ceil(N / world) samples and runs the same number of steps (a rank with fewer steps would
  /// leave the others waiting in a collective). Evaluation: false, every sample exactly once.
  TORCH_ARG(bool, pad_to_equal) = true;
  /// Drop the tail instead of padding: every rank gets floor(N / world) samples.
  TORCH_ARG(bool, drop_last) = false;
  /// Positions of the epoch order already consumed (a resumed epoch): only positions from here
  /// on are dealt, round-robin, padded (or cut) to equal shards as above. With the world size
  /// that consumed them, rank r sees exactly the rest of its own shard; with another world size
  /// the remaining samples are re-sharded.
  TORCH_ARG(uint64_t, start_position) = 0;
};

}  // namespace trainloop::data

namespace trainloop::detail {

/// Uniform integer in [0, bound) from a 64-bit engine by rejection, so the permutation is the
/// same on every platform (std::uniform_int_distribution's algorithm is implementation-defined,
/// and ranks may be built by different standard libraries).
inline uint64_t uniform_below(std::mt19937_64& engine, uint64_t bound) {
  const uint64_t limit = std::numeric_limits<uint64_t>::max() -
                         std::numeric_limits<uint64_t>::max() % bound;
  uint64_t draw = engine();
  while (draw >= limit) draw = engine();
  return draw % bound;
}

/// The permutation of [0, n) for one seed: Fisher-Yates on mt19937_64 (fully specified by the
/// standard, so identical across ranks, machines and libtorch versions).
inline std::vector<size_t> seeded_permutation(size_t n, uint64_t seed) {
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::mt19937_64 engine(seed);
  for (size_t i = n; i > 1; --i) {
    std::swap(order[i - 1], order[uniform_below(engine, i)]);
  }
  return order;
}

}  // namespace trainloop::detail

namespace trainloop::data {

/// @brief The index list of one rank for one epoch.
///
/// Positions of the epoch order (a permutation of [0, N) when shuffling, else 0..N-1) are dealt
/// round-robin: rank r gets positions r, r+w, r+2w, ... With `pad_to_equal` the order is first
/// extended by repeating its start up to a multiple of w; with `drop_last` it is cut to
/// floor(N/w)*w; with neither, ranks may differ by one sample and every sample is visited once.
class ShardSampler {
 public:
  /// @brief A sampler for `rank` of `world_size` over a dataset of `dataset_size` samples.
  /// @throws trainloop::Error when world_size is 0, rank >= world_size, the dataset is empty,
  ///         or (padding or drop_last) world_size > dataset_size.
  ShardSampler(size_t dataset_size, size_t rank, size_t world_size,
               ShardSamplerOptions options = {})
      : dataset_size_(dataset_size), rank_(rank), world_size_(world_size),
        options_(std::move(options)) {
    TRAINLOOP_CHECK(world_size >= 1, "world size ", world_size, "; expected at least 1");
    TRAINLOOP_CHECK(rank < world_size, "rank ", rank, " is out of range for world size ",
                    world_size, "; expected 0 <= rank < ", world_size);
    TRAINLOOP_CHECK(dataset_size > 0, "the dataset is empty (0 samples); expected at least one");
    TRAINLOOP_CHECK(!(options_.pad_to_equal() || options_.drop_last()) ||
                        dataset_size >= world_size,
                    "world size ", world_size, " is larger than the dataset (", dataset_size,
                    " samples); expected at least one training sample per rank");
  }

  /// @brief 0..N-1 in order on one rank: libtorch's SequentialSampler, without a permutation.
  static ShardSampler sequential(size_t dataset_size) {
    return {dataset_size, 0, 1, ShardSamplerOptions().shuffle(false)};
  }

  /// @brief An evaluation shard: in order, no padding, every sample on exactly one rank.
  static ShardSampler evaluation(size_t dataset_size, size_t rank, size_t world_size) {
    return {dataset_size, rank, world_size,
            ShardSamplerOptions().shuffle(false).pad_to_equal(false)};
  }

  /// @brief Chooses the epoch whose order indices() returns; call it at the start of every
  /// epoch, with the same value on every rank.
  void set_epoch(uint64_t epoch) noexcept { epoch_ = epoch; }
  /// @brief The epoch last set (0 initially).
  uint64_t epoch() const noexcept { return epoch_; }

  /// @brief How many indices indices() returns on this rank (without building them).
  size_t num_samples() const noexcept {
    const size_t begin = first_position() + rank_;
    const size_t end = order_length();
    return end > begin ? (end - begin + world_size_ - 1) / world_size_ : 0;
  }

  /// @brief This rank's sample indices for the current epoch, in visiting order.
  std::vector<size_t> indices() const {
    const size_t n = dataset_size_;
    const size_t begin = first_position() + rank_;
    const auto positions =
        ranges::views::iota(std::min(begin, order_length()), order_length()) | ranges::views::stride(world_size_);
    if (!options_.shuffle()) {
      // Padding repeats the start of the order, hence the wrap-around.
      return positions | ranges::views::transform([n](size_t p) { return p % n; }) |
             ranges::to<std::vector>();
    }
    const auto order = detail::seeded_permutation(n, options_.seed() + epoch_);
    return positions | ranges::views::transform([&](size_t p) { return order[p % n]; }) |
           ranges::to<std::vector>();
  }

  size_t dataset_size() const noexcept { return dataset_size_; }  ///< N
  size_t rank() const noexcept { return rank_; }                  ///< this rank
  size_t world_size() const noexcept { return world_size_; }      ///< number of ranks
  const ShardSamplerOptions& options() const noexcept { return options_; }  ///< as given

 private:
  /// The first position dealt out (positions before it were consumed already).
  size_t first_position() const noexcept {
    return static_cast<size_t>(std::min<uint64_t>(options_.start_position(), dataset_size_));
  }
  /// End of the positions dealt out, after padding or dropping the remaining ones to a
  /// multiple of the world size.
  size_t order_length() const noexcept {
    const size_t start = first_position();
    const size_t remaining = dataset_size_ - start;
    if (options_.drop_last()) return start + remaining / world_size_ * world_size_;
    if (options_.pad_to_equal()) {
      return start + (remaining + world_size_ - 1) / world_size_ * world_size_;
    }
    return dataset_size_;
  }

  size_t dataset_size_;
  size_t rank_;
  size_t world_size_;
  ShardSamplerOptions options_;
  uint64_t epoch_ = 0;
};

}  // namespace trainloop::data
