#pragma once
/// @file
/// @brief Which samples this process reads in an epoch: the mode's data shard, shuffled by the
/// epoch's seed, resumed from a position inside the epoch.

#include <trainloop/data/shard_sampler.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/options.hpp>

#include <cstdint>
#include <vector>

namespace trainloop::detail {

/// The sampler of this process's part of a dataset.
/// Training shards are shuffled per epoch and, unless `pad_training` is false, padded with repeated
/// samples so every rank runs the same number of steps (PyTorch's DistributedSampler); unpadded
/// training shards are for exact uneven batches (loop/epoch_batch_plan.hpp). Evaluation shards are
/// neither shuffled nor padded, so every sample is counted exactly once over all ranks.
/// `seed` is the loop's sampler seed; `start_position` the positions of the epoch already
/// trained (a resumed epoch).
inline data::ShardSampler shard_sampler(size_t dataset_size, const DataShard& shard, bool training,
                                        const TrainLoopOptions& options, uint64_t seed, uint64_t start_position = 0,
                                        bool pad_training = true) {
  return data::ShardSampler(dataset_size, static_cast<size_t>(shard.rank), static_cast<size_t>(shard.world_size),
                            data::ShardSamplerOptions()
                                .shuffle(training && options.shuffle())
                                .seed(seed)
                                .pad_to_equal(training && pad_training)
                                .drop_last(false)
                                .start_position(start_position));
}

/// This process's indices of a dataset for one epoch (see shard_sampler()).
inline std::vector<size_t> shard_indices(size_t dataset_size, const DataShard& shard, bool training,
                                         const TrainLoopOptions& options, int64_t epoch, uint64_t seed = 0,
                                         uint64_t start_position = 0, bool pad_training = true) {
  auto sampler = shard_sampler(dataset_size, shard, training, options, seed, start_position, pad_training);
  sampler.set_epoch(static_cast<uint64_t>(epoch));
  return sampler.indices();
}

}  // namespace trainloop::detail
