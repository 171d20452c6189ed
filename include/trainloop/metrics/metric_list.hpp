#pragma once
/// @file
/// @brief The metrics of TrainLoopOptions: `metrics({Accuracy(), TopKAccuracy(5)})`, metrics by
/// value or as shared_ptrs, as fit() takes callbacks (callbacks/callback.hpp's CallbackList).

#include <trainloop/metrics/metric.hpp>

#include <concepts>
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief One metric given to TrainLoopOptions::metrics: by value (`Accuracy()`, copied into the
/// list) or as a shared_ptr (one object shared with the caller; metrics hold no state, so either
/// computes the same values).
class MetricArg {
 public:
  /// @brief A metric shared with the caller.
  template <std::derived_from<Metric> T>
  MetricArg(std::shared_ptr<T> metric) : metric_(std::move(metric)) {}  // NOLINT: implicit on purpose
  /// @brief A metric by value: the list holds its own copy.
  template <class T>
    requires std::derived_from<std::remove_cvref_t<T>, Metric>
  MetricArg(T&& metric)  // NOLINT: implicit on purpose
      : metric_(std::make_shared<std::remove_cvref_t<T>>(std::forward<T>(metric))) {}
  /// @brief The metric.
  const std::shared_ptr<Metric>& get() const { return metric_; }

 private:
  std::shared_ptr<Metric> metric_;
};

/// @brief The metrics of a loop, in the order they are computed and shown:
/// `TrainLoopOptions().metrics({Accuracy(), std::make_shared<TopKAccuracy>(5)})`, metrics by
/// value and shared_ptrs mixed. A vector of shared_ptrs, so code written for one reads it as before.
class MetricList : public std::vector<std::shared_ptr<Metric>> {
 public:
  MetricList() = default;
  /// @brief From metrics by value or shared_ptrs.
  MetricList(std::initializer_list<MetricArg> metrics) {
    reserve(metrics.size());
    for (const auto& metric : metrics) push_back(metric.get());
  }
  /// @brief From a vector of shared_ptrs.
  MetricList(std::vector<std::shared_ptr<Metric>> metrics)  // NOLINT: implicit on purpose
      : std::vector<std::shared_ptr<Metric>>(std::move(metrics)) {}
};

}  // namespace trainloop
