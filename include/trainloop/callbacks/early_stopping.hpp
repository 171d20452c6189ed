#pragma once
/// @file
/// @brief EarlyStopping (Lightning's, Keras's): stops training when the monitored value has not
/// improved by more than min_delta for `patience` epochs; optionally puts the best epoch's
/// weights back at the end.
///
/// @code
/// auto stop = std::make_shared<trainloop::EarlyStopping>(
///     trainloop::EarlyStoppingOptions("val_accuracy").mode(trainloop::MonitorMode::Max).patience(3).restore_best_weights(true));
/// loop.fit(100, {stop});
/// @endcode
///
/// Under DDP every rank runs it on the same, all-reduced epoch record, and the loop makes every
/// rank agree on the stop before any leaves (TrainState::request_stop), so no rank is left
/// waiting in a collective. Its counters and best weights travel in checkpoints.
///
/// The best weights are kept as each rank holds them (TrainState::copy_own_weights): under
/// gpu_mode::FullyShardedDataParallel at sharding full that is this rank's shares of the
/// parameters (1/W of the model, no gather), put back at the end exactly as plain DDP puts back
/// its whole copy. Shares cannot travel in a checkpoint (rank 0 writes it; every rank would read
/// rank 0's): a checkpoint then keeps the counters only, and a resumed fit restores the best
/// weights only if a new best epoch comes (it says so on stderr otherwise).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/monitor.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <trainloop/detail/module_tensors.hpp>

#include <torch/torch.h>

#include <iostream>
#include <limits>
#include <string>
#include <vector>

namespace trainloop {

/// @brief Options of EarlyStopping.
struct EarlyStoppingOptions {
  /// @param monitor the value to watch (see callbacks/monitor.hpp), e.g. "val_loss"
  explicit EarlyStoppingOptions(std::string monitor = "val_loss") : monitor_(std::move(monitor)) {}
  /// The monitored value.
  TORCH_ARG(std::string, monitor);
  /// Whether smaller or larger is better.
  TORCH_ARG(MonitorMode, mode) = MonitorMode::Min;
  /// Epochs without improvement before stopping.
  TORCH_ARG(int64_t, patience) = 3;
  /// An improvement must exceed this (absolute) amount to count.
  TORCH_ARG(double, min_delta) = 0.0;
  /// At the end of the fit, load the weights (parameters and buffers) of the best epoch.
  TORCH_ARG(bool, restore_best_weights) = false;
};

/// @brief Stops training when the monitored value stops improving (see the file comment).
class EarlyStopping : public Callback {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit EarlyStopping(EarlyStoppingOptions options = EarlyStoppingOptions()) : options_(std::move(options)) {
    TRAINLOOP_CHECK(options_.patience() >= 1, "early stopping patience is ", options_.patience(),
                    "; expected 1 or more epochs");
    TRAINLOOP_CHECK(options_.min_delta() >= 0.0, "early stopping min_delta is ", options_.min_delta(),
                    "; expected 0 or more");
    best_ = options_.mode() == MonitorMode::Min ? std::numeric_limits<double>::infinity()
                                                : -std::numeric_limits<double>::infinity();
  }

  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    const double value = monitored_value(record, options_.monitor(), "EarlyStopping");
    if (improves(value, best_, options_.mode(), options_.min_delta())) {
      best_ = value;
      best_epoch_ = record.epoch;
      waited_ = 0;
      if (options_.restore_best_weights()) keep_weights(state);
    } else if (++waited_ >= options_.patience()) {
      stopped_epoch_ = record.epoch;
      state.request_stop(detail::concat("EarlyStopping: ", options_.monitor(), " did not improve for ", waited_,
                                        " epochs (best ", best_, " at epoch ", best_epoch_, ")"));
    }
  }

  void on_fit_end(TrainState& state, const History&) override {
    if (!options_.restore_best_weights()) return;
    if (best_weights_.empty()) {
      if (best_weights_lost_) {
        std::cerr << "trainloop: EarlyStopping did not restore the weights of epoch " << best_epoch_ << ": they were "
                  << "kept as shares, which checkpoints do not hold, and no better epoch came after the resume\n";
      }
      return;
    }
    if (state.restore_own_weights) {
      state.restore_own_weights(OwnWeights{best_weights_, best_are_shares_});
      return;
    }
    torch::NoGradGuard no_grad;
    auto targets = detail::state_tensors(*state.model);
    TRAINLOOP_CHECK(targets.size() == best_weights_.size(), "EarlyStopping kept ", best_weights_.size(),
                    " tensors of the best epoch but the model has ", targets.size(), "; expected the same model");
    for (size_t i = 0; i < targets.size(); ++i) targets[i].copy_(best_weights_[i]);
  }

  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("counters", torch::tensor({best_, static_cast<double>(best_epoch_), static_cast<double>(waited_),
                                             static_cast<double>(stopped_epoch_)},
                                            torch::kFloat64));
    if (best_are_shares_ && !best_weights_.empty()) {
      archive.write("best_weights_were_shares", torch::ones({1}));  // rank 0's shares alone restore nothing
      return;
    }
    for (size_t i = 0; i < best_weights_.size(); ++i) archive.write("best_weight_" + std::to_string(i), best_weights_[i]);
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor counters;
    if (!archive.try_read("counters", counters)) return;
    best_ = counters[0].item<double>();
    best_epoch_ = static_cast<int64_t>(counters[1].item<double>());
    waited_ = static_cast<int64_t>(counters[2].item<double>());
    stopped_epoch_ = static_cast<int64_t>(counters[3].item<double>());
    best_weights_.clear();
    best_are_shares_ = false;
    torch::Tensor were_shares;
    best_weights_lost_ = archive.try_read("best_weights_were_shares", were_shares);
    for (torch::Tensor weight; archive.try_read("best_weight_" + std::to_string(best_weights_.size()), weight);) {
      best_weights_.push_back(weight);
      weight = torch::Tensor();
    }
  }

  /// @brief The best monitored value so far.
  double best() const { return best_; }
  /// @brief The epoch of the best value (0 before any).
  int64_t best_epoch() const { return best_epoch_; }
  /// @brief The epoch after which it asked to stop (0 if it did not).
  int64_t stopped_epoch() const { return stopped_epoch_; }

 private:
  void keep_weights(TrainState& state) {
    best_weights_lost_ = false;
    if (state.copy_own_weights) {
      OwnWeights own = state.copy_own_weights();
      best_weights_ = std::move(own.tensors);
      best_are_shares_ = own.shares;
      return;
    }
    best_weights_.clear();
    best_are_shares_ = false;
    for (const auto& t : detail::state_tensors(*state.model)) best_weights_.push_back(t.detach().clone());
  }

  EarlyStoppingOptions options_;
  double best_ = 0.0;
  int64_t best_epoch_ = 0;
  int64_t waited_ = 0;
  int64_t stopped_epoch_ = 0;
  std::vector<torch::Tensor> best_weights_;
  bool best_are_shares_ = false;   // best_weights_ are this rank's shares (TrainState::copy_own_weights)
  bool best_weights_lost_ = false; // a resumed checkpoint had shares in their place
};

}  // namespace trainloop
