#pragma once
/// @file
/// @brief The metric interface: a metric is a vector of sufficient statistics (sums and counts)
/// plus a function from their totals to a number.
///
/// Why sums and not values: a mean of per-batch (or per-rank) means is wrong whenever batches or
/// shards differ in size. Sums add exactly across batches, threads and ranks; the value is
/// computed once, from the reduced totals.

#include <torch/torch.h>

#include <string>

namespace trainloop {

/// A metric computed from sufficient statistics.
///
/// Implement `statistics()` to return a 1-D float64 tensor of sums for one batch (same length on
/// every call) and `compute()` to turn the totals over all batches (and ranks) into the value.
/// Metrics hold no state, so one object may be used from many threads and ranks at once.
class Metric {
 public:
  virtual ~Metric() = default;
  /// @brief Name shown in progress output, history columns and CSV headers (e.g. "accuracy").
  virtual std::string name() const = 0;
  /// @brief Number of sufficient statistics this metric keeps.
  virtual int64_t num_statistics() const = 0;
  /// @brief Sums for one batch, as a 1-D float64 tensor of length num_statistics(), on the
  /// device of `output` (no host synchronisation in the training loop).
  /// @param output the model's output for the batch (detached)
  /// @param target the batch's targets
  virtual torch::Tensor statistics(const torch::Tensor& output, const torch::Tensor& target) const = 0;
  /// @brief The metric's value from the totals of statistics() over every batch and rank.
  virtual double compute(const torch::Tensor& totals) const = 0;
};

}  // namespace trainloop
