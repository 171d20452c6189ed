#pragma once
/// @file
/// @brief What fit() returns: one record per epoch, and the result of evaluate().

#include <trainloop/error.hpp>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace trainloop {

/// @brief Loss and metrics over one dataset, every sample counted exactly once.
struct EvalResult {
  double loss = 0.0;                      ///< mean loss per sample
  int64_t samples = 0;                    ///< number of samples evaluated (over all ranks)
  std::map<std::string, double> metrics;  ///< metric name -> value
};

/// @brief Everything measured in one epoch.
struct EpochRecord {
  int64_t epoch = 0;                      ///< 1-based epoch number
  int64_t steps = 0;                      ///< optimizer steps taken in this epoch
  int64_t samples = 0;                    ///< training samples processed (over all ranks)
  double train_loss = 0.0;                ///< mean training loss per sample
  std::map<std::string, double> train_metrics;  ///< training metric name -> value
  std::optional<EvalResult> validation;   ///< present when a validation set was given
  double seconds = 0.0;                   ///< wall time of the training part of the epoch
  double samples_per_second = 0.0;        ///< samples / seconds, over all ranks
  /// Of `seconds`, the time the training thread waited for the loader to hand it a batch (on this
  /// process; under DDP the History is rank 0's): near 0 when the loader keeps up, near `seconds` when it sets the pace.
  double data_wait_seconds = 0.0;
  double learning_rate = 0.0;             ///< learning rate (first param group) of the epoch's last step
  std::optional<double> momentum;         ///< momentum (SGD) or beta1 (Adam, AdamW) of that step, when the optimizer has one
  /// Bytes of optimizer state (Adam's moments, SGD's momentum...) the rank holding the most held
  /// at the epoch's end: the whole state without ZeRO, about 1/W of it with
  /// (gpu_mode::DistributedDataParallel::zero; optimizer_state_bytes()).
  int64_t optimizer_state_bytes = 0;
  /// Each rank's bytes of optimizer state at the epoch's end, in rank order (one entry without DDP).
  std::vector<int64_t> optimizer_state_bytes_by_rank;
};

/// @brief One optimizer step, recorded when TrainLoopOptions::record_steps is on.
struct StepRecord {
  int64_t step = 0;               ///< global step number, 1-based (the step this record describes)
  int64_t epoch = 0;              ///< the epoch it belongs to
  double learning_rate = 0.0;     ///< learning rate (first param group) the step was taken with
  std::optional<double> momentum;  ///< momentum or Adam's beta1 it was taken with
  double loss = 0.0;              ///< mean loss of its last micro-batch on this process
};

/// @brief A rank that slowed every other, as the straggler watch logged it on the main process
/// (DDP and fsdp: distributed/watch/straggler_watch.hpp), or the end of it.
struct StragglerRecord {
  int64_t step = 0;          ///< the newest step any rank had completed when it was logged
  int64_t rank = -1;         ///< the rank
  int64_t pid = 0;           ///< its process (0: not known)
  std::string host;          ///< its machine
  std::string part;          ///< where it loses most time per step: input, forward, backward or optimizer
  double excess_ms = 0.0;    ///< by how much per step it trailed the median of the others
  bool ended = false;        ///< true: it no longer trails (part and excess_ms are from when it was named)
};

/// @brief The per-epoch records of a loop's training so far: every epoch of every fit() call of
/// the loop (and of the checkpoint it resumed from), as fit() returns them.
struct History {
  std::vector<EpochRecord> epochs;  ///< one record per epoch run (a partial last epoch included)
  int64_t total_steps = 0;          ///< optimizer steps taken so far (all fit() calls, resumed ones included)
  std::string stop_reason;          ///< why fit() ended early (a callback's reason), empty if it did not
  std::vector<StepRecord> steps;    ///< one record per optimizer step, when TrainLoopOptions::record_steps is on
  /// Every straggler named (and every end of one) in the order the main process logged them (on
  /// rank 0; the History fit() returns is rank 0's). Empty without ranks or with the watch off.
  std::vector<StragglerRecord> stragglers;

  /// @brief The last epoch's record; throws std::out_of_range when no epoch ran.
  const EpochRecord& last() const { return epochs.at(epochs.size() - 1); }

  /// @brief The last epoch's validation value of the metric called `name` (a Metric's name(),
  /// e.g. "accuracy"): `history.validation("accuracy")`.
  /// @throws trainloop::ConfigurationError naming the metrics the last epoch has, when it has no
  ///         metric of that name, ran no validation, or when no epoch ran.
  double validation(const std::string& name) const {
    const EvalResult& result = last_validation(detail::concat("validation metric '", name, "'"));
    const auto found = result.metrics.find(name);
    TRAINLOOP_CHECK(found != result.metrics.end(), "validation metric '", name,
                    "' is not recorded; the last epoch has: ", metric_names(result.metrics));
    return found->second;
  }
  /// @brief The last epoch's training value of the metric called `name`: `history.train("accuracy")`.
  /// @throws trainloop::ConfigurationError naming the metrics the last epoch has, when it has no
  ///         metric of that name, or when no epoch ran.
  double train(const std::string& name) const {
    const EpochRecord& record = last_epoch(detail::concat("training metric '", name, "'"));
    const auto found = record.train_metrics.find(name);
    TRAINLOOP_CHECK(found != record.train_metrics.end(), "training metric '", name,
                    "' is not recorded; the last epoch has: ", metric_names(record.train_metrics));
    return found->second;
  }
  /// @brief The last epoch's mean validation loss per sample.
  /// @throws trainloop::ConfigurationError when the last epoch ran no validation, or no epoch ran.
  double validation_loss() const { return last_validation("validation loss").loss; }
  /// @brief The last epoch's mean training loss per sample.
  /// @throws trainloop::ConfigurationError when no epoch ran.
  double train_loss() const { return last_epoch("training loss").train_loss; }

 private:
  // "accuracy, top5_accuracy", or why there is none.
  static std::string metric_names(const std::map<std::string, double>& metrics) {
    if (metrics.empty()) return "no metric (TrainLoopOptions::metrics is empty)";
    std::string names;
    for (const auto& [metric, value] : metrics) names += (names.empty() ? "" : ", ") + metric;
    return names;
  }
  const EpochRecord& last_epoch(const std::string& what) const {
    TRAINLOOP_CHECK(!epochs.empty(), what, " is not recorded: the History has no epoch; expected one trained by fit()");
    return epochs.back();
  }
  const EvalResult& last_validation(const std::string& what) const {
    const EpochRecord& record = last_epoch(what);
    TRAINLOOP_CHECK(record.validation.has_value(), what, " is not recorded; the last epoch (", record.epoch,
                    ") ran no validation: expected a validation dataset given to the TrainLoop, and an epoch that "
                    "fit() finished (not one it stopped inside)");
    return *record.validation;
  }
};

}  // namespace trainloop
