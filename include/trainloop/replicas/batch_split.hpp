#pragma once
/// @file
/// @brief Cutting a batch into contiguous shards along the sample dimension, one per replica
/// (gpu_mode::DataParallel).
///
/// Shard sizes differ by at most one, larger shards first: 7 samples over 3 replicas give 3, 2, 2;
/// a batch smaller than the replica count gives one single-sample shard per sample. Batches of
/// `torch::data::Example<>` are split here; another batch type supplies its own
/// `std::vector<Batch> split(int64_t parts) const`.

#include <trainloop/error.hpp>
#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <vector>

namespace trainloop::detail {

/// Sizes of the contiguous shards that `samples` samples are cut into for `parts` replicas:
/// min(parts, samples) shards, sizes differing by at most one, larger ones first.
inline std::vector<int64_t> shard_sizes(int64_t samples, int64_t parts) {
  TRAINLOOP_CHECK(samples >= 1, "a batch of ", samples, " samples cannot be split; expected at least 1 sample");
  TRAINLOOP_CHECK(parts >= 1, "a batch cannot be split into ", parts, " parts; expected at least 1");
  const int64_t shards = std::min(parts, samples);
  const int64_t base = samples / shards;
  const int64_t larger = samples % shards;  // this many shards get one extra sample
  std::vector<int64_t> sizes(static_cast<size_t>(shards), base);
  for (int64_t i = 0; i < larger; ++i) ++sizes[static_cast<size_t>(i)];
  return sizes;
}

/// True when a batch type can cut itself into shards: `std::vector<Batch> split(int64_t) const`.
template <class Batch>
concept SelfSplittingBatch = requires(const Batch& batch, int64_t parts) {
  { batch.split(parts) } -> std::convertible_to<std::vector<Batch>>;
};

/// True when gpu_mode::DataParallel can split batches of this type.
template <class Batch>
inline constexpr bool splittable_batch_v = is_example_batch_v<Batch> || SelfSplittingBatch<Batch>;

/// Splits an (input, target) batch into contiguous views; the target is split with the input.
inline std::vector<torch::data::Example<>> split_example_batch(const torch::data::Example<>& batch, int64_t parts) {
  TRAINLOOP_CHECK(batch.data.defined() && batch.data.dim() >= 1,
                  "a batch whose input has no sample dimension cannot be split across replicas; expected an input of "
                  "shape [samples, ...]");
  const int64_t samples = batch.data.size(0);
  const bool has_target = batch.target.defined();
  TRAINLOOP_CHECK(!has_target || (batch.target.dim() >= 1 && batch.target.size(0) == samples),
                  "the batch's target has shape ", has_target ? batch.target.sizes() : c10::IntArrayRef{},
                  " but its input has ", samples, " samples; expected a target of shape [", samples,
                  ", ...] so it can be split across replicas with the input");
  std::vector<torch::data::Example<>> shards;
  int64_t offset = 0;
  for (int64_t size : shard_sizes(samples, parts)) {
    shards.push_back({batch.data.narrow(0, offset, size), has_target ? batch.target.narrow(0, offset, size) : batch.target});
    offset += size;
  }
  return shards;
}

/// Splits any batch gpu_mode::DataParallel supports into at most `parts` non-empty shards.
/// @throws trainloop::Error when a batch type's own split() returns an unusable list.
template <class Batch>
std::vector<Batch> split_batch(const Batch& batch, int64_t parts) {
  if constexpr (is_example_batch_v<Batch>) {
    return split_example_batch(batch, parts);
  } else {
    static_assert(SelfSplittingBatch<Batch>,
                  "trainloop: gpu_mode::DataParallel cannot split this batch type across replicas. Give it a member "
                  "`std::vector<Batch> split(int64_t parts) const` that cuts it into at most `parts` non-empty, "
                  "consecutive shards along the sample dimension (or train on torch::data::Example<> batches).");
    std::vector<Batch> shards = batch.split(parts);
    TRAINLOOP_CHECK(!shards.empty() && static_cast<int64_t>(shards.size()) <= parts, "the batch type's split(", parts,
                    ") returned ", shards.size(), " shards; expected between 1 and ", parts);
    int64_t total = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      const int64_t size = batch_size_of(shards[i]);
      TRAINLOOP_CHECK(size > 0, "shard ", i, " returned by the batch type's split(", parts,
                      ") is empty; expected non-empty shards");
      total += size;
    }
    TRAINLOOP_CHECK(total == batch_size_of(batch), "the shards returned by the batch type's split(", parts, ") hold ",
                    total, " samples but the batch holds ", batch_size_of(batch), "; expected every sample exactly once");
    return shards;
  }
}

}  // namespace trainloop::detail
