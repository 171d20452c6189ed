#pragma once
/// @file
/// @brief Step decay (PyTorch's StepLR and MultiStepLR): the learning rate is multiplied by
/// gamma at each milestone epoch of the fit() call, counted from its first epoch.
///
/// @code
/// std::make_shared<trainloop::MultiStep>(std::vector<int64_t>{30, 60}, 0.1);  // epochs 31.. at lr/10, 61.. at lr/100
/// trainloop::MultiStep::every(10, 0.5);                                        // halve every 10 epochs
/// @endcode

#include <trainloop/error.hpp>
#include <trainloop/schedules/step_schedule.hpp>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace trainloop {

/// @brief Multiplies the learning rate by gamma after each milestone epoch.
class MultiStep : public StepSchedule {
 public:
  /// @param milestones epochs of the fit (1-based counts of finished epochs) after which the rate drops
  /// @param gamma the factor applied at each milestone
  /// @throws trainloop::ConfigurationError unless the milestones are positive and increasing, and gamma positive.
  MultiStep(std::vector<int64_t> milestones, double gamma = 0.1) : milestones_(std::move(milestones)), gamma_(gamma) {
    TRAINLOOP_CHECK(gamma_ > 0.0, "step decay gamma is ", gamma_, "; expected a positive factor");
    for (size_t i = 0; i < milestones_.size(); ++i) {
      TRAINLOOP_CHECK(milestones_[i] > 0 && (i == 0 || milestones_[i] > milestones_[i - 1]), "step decay milestone ",
                      milestones_[i], " (position ", i, "); expected positive epochs in increasing order");
    }
  }
  /// @brief StepLR: multiply by gamma every `epochs` epochs (up to 10,000 epochs).
  static std::shared_ptr<MultiStep> every(int64_t epochs, double gamma = 0.1) {
    TRAINLOOP_CHECK(epochs > 0, "step decay every ", epochs, " epochs; expected a positive number of epochs");
    std::vector<int64_t> milestones;
    for (int64_t e = epochs; e <= 10000; e += epochs) milestones.push_back(e);
    return std::make_shared<MultiStep>(std::move(milestones), gamma);
  }

  void on_fit_begin(TrainState& state) override {
    epochs_done_ = state.epoch - state.first_epoch;
    StepSchedule::on_fit_begin(state);
  }
  void on_epoch_begin(TrainState& state) override { epochs_done_ = state.epoch - state.first_epoch; }

  ScheduledValues values_at(int64_t, int64_t, const ScheduledValues& base) const override {
    const auto passed = std::upper_bound(milestones_.begin(), milestones_.end(), epochs_done_) - milestones_.begin();
    return {base.learning_rate * std::pow(gamma_, static_cast<double>(passed)), std::nullopt};
  }

 private:
  std::vector<int64_t> milestones_;
  double gamma_;
  int64_t epochs_done_ = 0;
};

}  // namespace trainloop
