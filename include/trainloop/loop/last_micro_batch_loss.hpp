#pragma once
/// @file
/// @brief The loss of an epoch's last micro-batch, as TrainState::last_loss reads it: the shards'
/// losses weighted by their samples, summed on the device and read only when asked.

#include <trainloop/model_contract.hpp>

#include <torch/torch.h>

#include <cstdint>

namespace trainloop::detail {

/// The last micro-batch's loss: its shards' losses weighted by their samples (DataParallel sinks
/// one output per replica), summed lazily so nothing synchronises unless someone asks.
class LastMicroBatchLoss {
 public:
  /// The next output starts a new micro-batch.
  void start() { fresh_ = true; }

  void add(const StepOutput& out) {
    const auto weighted = out.loss.detach().to(torch::kFloat64) * static_cast<double>(out.samples);
    if (fresh_ || !loss_.defined()) {
      loss_ = weighted;
      samples_ = out.samples;
      fresh_ = false;
    } else {
      loss_ = loss_ + weighted.to(loss_.device());
      samples_ += out.samples;
    }
  }

  /// The mean loss per sample (a host sync); 0 before the first output.
  double value() const { return loss_.defined() && samples_ > 0 ? loss_.item<double>() / static_cast<double>(samples_) : 0.0; }

 private:
  torch::Tensor loss_;
  int64_t samples_ = 0;
  bool fresh_ = true;
};

}  // namespace trainloop::detail
