#pragma once
/// @file
/// @brief Running sums of loss and metric statistics over an epoch, kept on the device so the
/// per-batch path never waits for the host; reduced across ranks once, at the end.

#include <trainloop/metrics/metric.hpp>

#include <map>
#include <memory>
#include <string>
#include <vector>

namespace trainloop::detail {

/// Loss and metric values computed from reduced totals.
struct MetricValues {
  double loss = 0.0;                        ///< mean loss per sample
  int64_t samples = 0;                      ///< samples counted
  std::map<std::string, double> metrics;    ///< metric name -> value
};

/// Accumulates (loss sum, sample count, every metric's statistics) as one float64 tensor.
class MetricAccumulator {
 public:
  MetricAccumulator(std::vector<std::shared_ptr<Metric>> metrics, torch::Device device)
      : metrics_(std::move(metrics)), device_(device) {
    int64_t width = 2;
    for (const auto& m : metrics_) width += m->num_statistics();
    totals_ = torch::zeros({width}, torch::TensorOptions().dtype(torch::kFloat64).device(device_));
  }

  /// Adds a batch's mean loss, weighted by its sample count (so uneven batches stay exact).
  /// The sample count stays on the host until packed_totals() is read: one kernel less per batch.
  void add_loss(const torch::Tensor& mean_loss, int64_t batch_samples) {
    totals_.narrow(0, 0, 1).add_(mean_loss.detach().to(device_, torch::kFloat64).reshape({1}),
                                 static_cast<double>(batch_samples));
    samples_ += batch_samples;
  }

  /// Adds every metric's statistics for one batch (or one shard of a batch).
  void add_outputs(const torch::Tensor& output, const torch::Tensor& target) {
    if (metrics_.empty()) return;
    auto detached = output.detach();
    int64_t offset = 2;
    for (const auto& m : metrics_) {
      auto stats = m->statistics(detached, target).to(device_, torch::kFloat64);
      totals_.narrow(0, offset, m->num_statistics()) += stats;
      offset += m->num_statistics();
    }
  }

  /// Continues from totals packed by packed_totals() (a resumed epoch): sums, count and all.
  void restore(const torch::Tensor& packed) {
    totals_.copy_(packed.to(device_, torch::kFloat64).reshape({-1}));
    samples_ = static_cast<int64_t>(packed.to(torch::kCPU)[1].item<double>());
    totals_[1].fill_(0.0);  // the count lives in samples_ until packed_totals()
  }

  /// Number of float64 values packed_totals() returns.
  int64_t width() const { return totals_.numel(); }

  /// Samples added so far on this process (host-side count, no synchronisation).
  int64_t local_samples() const { return samples_; }

  /// Mean loss so far on this process; synchronises with the device, so call it sparingly.
  double running_loss() const {
    return samples_ > 0 ? totals_[0].item<double>() / static_cast<double>(samples_) : 0.0;
  }

  /// A copy of the totals (loss sum, sample count, metric statistics) to reduce across ranks
  /// and pass to compute().
  torch::Tensor packed_totals() const {
    auto packed = totals_.clone();
    packed[1].fill_(static_cast<double>(samples_));
    return packed;
  }

  /// Values from (possibly reduced) totals.
  MetricValues compute(const torch::Tensor& totals) const {
    auto host = totals.to(torch::kCPU);
    MetricValues values;
    double n = host[1].item<double>();
    values.samples = static_cast<int64_t>(n);
    values.loss = n > 0 ? host[0].item<double>() / n : 0.0;
    int64_t offset = 2;
    for (const auto& m : metrics_) {
      values.metrics[m->name()] = m->compute(host.narrow(0, offset, m->num_statistics()));
      offset += m->num_statistics();
    }
    return values;
  }

 private:
  std::vector<std::shared_ptr<Metric>> metrics_;
  torch::Device device_;
  torch::Tensor totals_;
  int64_t samples_ = 0;
};

}  // namespace trainloop::detail
