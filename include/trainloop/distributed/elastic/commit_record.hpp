#pragma once
/// @file
/// @brief A step's commit under elastic training: once the step's gradients are reduced, every
/// rank's epoch sums (the metrics' sufficient statistics) and random stream are gathered to every
/// rank, before anyone steps the optimizer. A rank holding the commit of step S holds everything
/// a checkpoint of step S holds — its own parameters and optimizer state (replicated: every rank
/// steps the same reduced gradients) and every rank's sums and stream — so the survivors of a lost
/// rank resume from the newest commit any of them holds, as a run that changed its world size
/// at that step on purpose would resume from its checkpoint, and count every sample once.
///
/// One all-gather of a row per rank (the sums as float64 bytes, then the stream's bytes: ~5 KB
/// for the CPU generator, then 8 bytes: on rank 0 how many replacements wait to join,
/// admission.hpp), in place of nothing: measured in benchmarks/elastic_recovery.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainloop::distributed::elastic {

/// Every rank's sums and random stream at the commit of one step (see the file comment).
class CommitRecord {
 public:
  /// No commit yet in this fit.
  CommitRecord() = default;

  /// Gathers this rank's `totals` (1-D float64, the same length on every rank), `rng` (1-D
  /// uint8, the same length on every rank) and `joins_waiting` (rank 0's count is the one every
  /// rank reads) from every rank of `group`: a collective.
  static CommitRecord gather(ProcessGroup& group, std::int64_t step, const torch::Tensor& totals, const torch::Tensor& rng,
                             std::int64_t joins_waiting = 0) {
    TRAINLOOP_CHECK(totals.scalar_type() == torch::kFloat64 && totals.dim() == 1 && rng.scalar_type() == torch::kUInt8 &&
                        rng.dim() == 1,
                    "a step's commit holds 1-D float64 sums and a 1-D uint8 random stream; got ", totals.scalar_type(),
                    " ", totals.sizes(), " and ", rng.scalar_type(), " ", rng.sizes());
    const torch::Tensor sums = totals.to(torch::kCPU).contiguous();
    const torch::Tensor waiting = torch::full({1}, joins_waiting, torch::kInt64);
    const torch::Tensor row = torch::cat({sums.view(torch::kUInt8), rng.to(torch::kCPU).contiguous(), waiting.view(torch::kUInt8)});
    CommitRecord record;
    record.step_ = step;
    record.total_count_ = sums.numel();
    record.rows_ = group.all_gather(row).to(torch::kCPU);
    return record;
  }

  /// Whether a step was committed in this fit.
  bool committed() const { return rows_.defined(); }
  /// The committed step (global, counted over the run), -1 when none.
  std::int64_t step() const { return step_; }
  /// Ranks of the group that committed it.
  std::int64_t ranks() const { return rows_.defined() ? rows_.size(0) : 0; }
  /// Rank `rank`'s epoch sums at the commit (float64).
  torch::Tensor totals(std::int64_t rank) const {
    return rows_[rank].slice(0, 0, total_count_ * 8).clone().view(torch::kFloat64);
  }
  /// Rank `rank`'s random stream at the commit (uint8).
  torch::Tensor rng(std::int64_t rank) const { return rows_[rank].slice(0, total_count_ * 8, rows_.size(1) - 8).clone(); }
  /// How many replacements rank 0 saw waiting to join at the commit (the same on every rank).
  std::int64_t joins_waiting() const {
    return rows_.defined() ? rows_[0].slice(0, rows_.size(1) - 8).clone().view(torch::kInt64).item<std::int64_t>() : 0;
  }

 private:
  std::int64_t step_ = -1;
  std::int64_t total_count_ = 0;
  torch::Tensor rows_;  // [ranks, row bytes]
};

}  // namespace trainloop::distributed::elastic
