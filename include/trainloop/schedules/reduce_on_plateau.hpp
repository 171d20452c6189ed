#pragma once
/// @file
/// @brief Reduce-on-plateau (PyTorch's ReduceLROnPlateau): after `patience` epochs without an
/// improvement of the monitored value, the learning rate is multiplied by `factor`.
///
/// The monitored value is the epoch's record, reduced over every rank; the decision to reduce is
/// agreed by all ranks anyway (one small collective per epoch), so the ranks' optimizers never
/// disagree. Its counters travel in checkpoints.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/monitor.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/hyperparameters.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <algorithm>
#include <limits>
#include <string>

namespace trainloop {

/// @brief Options of ReduceOnPlateau; defaults are PyTorch's.
struct ReduceOnPlateauOptions {
  /// @param monitor the value to watch (see callbacks/monitor.hpp), e.g. "val_loss"
  explicit ReduceOnPlateauOptions(std::string monitor = "val_loss") : monitor_(std::move(monitor)) {}
  /// The monitored value.
  TORCH_ARG(std::string, monitor);
  /// Whether smaller or larger is better.
  TORCH_ARG(MonitorMode, mode) = MonitorMode::Min;
  /// The learning rate is multiplied by this.
  TORCH_ARG(double, factor) = 0.1;
  /// Epochs without improvement tolerated before a reduction.
  TORCH_ARG(int64_t, patience) = 10;
  /// Relative improvement that counts (PyTorch's threshold with threshold_mode "rel").
  TORCH_ARG(double, threshold) = 1e-4;
  /// Epochs to wait after a reduction before counting again.
  TORCH_ARG(int64_t, cooldown) = 0;
  /// The learning rate never goes below this.
  TORCH_ARG(double, min_lr) = 0.0;
};

/// @brief Lowers the learning rate when the monitored value stops improving.
class ReduceOnPlateau : public Callback {
 public:
  /// @throws trainloop::ConfigurationError naming an option out of range.
  explicit ReduceOnPlateau(ReduceOnPlateauOptions options = ReduceOnPlateauOptions()) : options_(std::move(options)) {
    TRAINLOOP_CHECK(options_.factor() > 0.0 && options_.factor() < 1.0, "reduce-on-plateau factor is ",
                    options_.factor(), "; expected a factor in (0, 1)");
    TRAINLOOP_CHECK(options_.patience() >= 0, "reduce-on-plateau patience is ", options_.patience(), "; expected 0 or more");
    TRAINLOOP_CHECK(options_.cooldown() >= 0, "reduce-on-plateau cooldown is ", options_.cooldown(), "; expected 0 or more");
    best_ = worst();
  }

  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    const double value = monitored_value(record, options_.monitor(), "ReduceOnPlateau");
    const double scale = options_.mode() == MonitorMode::Min ? 1.0 - options_.threshold() : 1.0 + options_.threshold();
    const bool better = options_.mode() == MonitorMode::Min ? value < best_ * scale : value > best_ * scale;
    if (better) {
      best_ = value;
      bad_epochs_ = 0;
    } else {
      ++bad_epochs_;
    }
    if (cooldown_left_ > 0) {
      --cooldown_left_;
      bad_epochs_ = 0;
    }
    if (state.any_rank(bad_epochs_ > options_.patience())) {
      bool reduced = false;
      for (auto& group : state.optimizer->param_groups()) {
        const double lr = group.options().get_lr();
        const double lowered = std::max(lr * options_.factor(), options_.min_lr());
        if (lr - lowered > 1e-8) {  // PyTorch's eps: at min_lr nothing changes, nothing is counted
          group.options().set_lr(lowered);
          reduced = true;
        }
      }
      if (reduced) {
        cooldown_left_ = options_.cooldown();
        ++reductions_;
      }
      bad_epochs_ = 0;
    }
  }

  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("state", torch::tensor({best_, static_cast<double>(bad_epochs_), static_cast<double>(cooldown_left_),
                                          static_cast<double>(reductions_)},
                                         torch::kFloat64));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor saved;
    if (!archive.try_read("state", saved)) return;
    best_ = saved[0].item<double>();
    bad_epochs_ = static_cast<int64_t>(saved[1].item<double>());
    cooldown_left_ = static_cast<int64_t>(saved[2].item<double>());
    reductions_ = static_cast<int64_t>(saved[3].item<double>());
  }

  /// @brief How many times the learning rate was lowered.
  int64_t reductions() const { return reductions_; }
  /// @brief The best monitored value so far.
  double best() const { return best_; }

 private:
  double worst() const {
    return options_.mode() == MonitorMode::Min ? std::numeric_limits<double>::infinity()
                                               : -std::numeric_limits<double>::infinity();
  }

  ReduceOnPlateauOptions options_;
  double best_ = 0.0;
  int64_t bad_epochs_ = 0;
  int64_t cooldown_left_ = 0;
  int64_t reductions_ = 0;
};

}  // namespace trainloop
