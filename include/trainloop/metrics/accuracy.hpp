#pragma once
/// @file
/// @brief Classification accuracy and top-k accuracy as (correct, count) sums.

#include <trainloop/error.hpp>
#include <trainloop/metrics/metric.hpp>

#include <memory>
#include <string>

namespace trainloop {

/// @brief Top-k accuracy: the fraction of samples whose target is among the k highest outputs.
///
/// Output is (batch, classes) scores; target is (batch) integer labels. Statistics are
/// (number correct, number of samples), so the value is exact across uneven batches and ranks.
class TopKAccuracy : public Metric {
 public:
  /// @param k how many of the highest-scoring classes count as a hit (k >= 1)
  explicit TopKAccuracy(int64_t k) : k_(k) {
    TRAINLOOP_CHECK(k >= 1, "top-k accuracy with k = ", k, "; expected k >= 1");
  }
  /// @brief "accuracy" for k = 1, "top<k>_accuracy" otherwise.
  std::string name() const override {
    return k_ == 1 ? std::string("accuracy") : "top" + std::to_string(k_) + "_accuracy";
  }
  /// @brief Two statistics: correct predictions and samples.
  int64_t num_statistics() const override { return 2; }
  /// @brief (correct, count) for one batch.
  torch::Tensor statistics(const torch::Tensor& output, const torch::Tensor& target) const override {
    TRAINLOOP_CHECK(output.dim() == 2, name(), " expects output of shape (batch, classes); got ",
                    output.sizes());
    // Soft targets (MixUp's mixed one-hot rows, label smoothing) count their most likely class.
    const torch::Tensor labels = target.dim() == 2 && target.sizes() == output.sizes() ? target.argmax(1) : target;
    TRAINLOOP_CHECK(labels.dim() == 1 && labels.size(0) == output.size(0), name(), " expects target of shape (",
                    output.size(0), ") or soft targets of shape ", output.sizes(), "; got ", target.sizes());
    TRAINLOOP_CHECK(k_ <= output.size(1), name(), " with k = ", k_, " but the output has only ",
                    output.size(1), " classes");
    torch::Tensor hits;
    if (k_ == 1) {
      hits = output.argmax(1).eq(labels).sum();
    } else {
      auto top = std::get<1>(output.topk(k_, /*dim=*/1));
      hits = top.eq(labels.unsqueeze(1)).any(1).sum();
    }
    auto count = torch::full({1}, static_cast<double>(output.size(0)),
                             torch::TensorOptions().dtype(torch::kFloat64).device(output.device()));
    return torch::cat({hits.to(torch::kFloat64).reshape({1}), count});
  }
  /// @brief correct / count (0 when no sample was seen).
  double compute(const torch::Tensor& totals) const override {
    auto t = totals.to(torch::kCPU);
    double count = t[1].item<double>();
    return count > 0 ? t[0].item<double>() / count : 0.0;
  }

 private:
  int64_t k_;
};

/// @brief Top-1 accuracy.
class Accuracy : public TopKAccuracy {
 public:
  Accuracy() : TopKAccuracy(1) {}
};

}  // namespace trainloop
