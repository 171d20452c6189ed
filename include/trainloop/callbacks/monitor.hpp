#pragma once
/// @file
/// @brief A monitored value of an epoch: what ModelCheckpoint, EarlyStopping and ReduceOnPlateau
/// watch. Names as in the CSV history and Lightning: `train_loss`, `train_<metric>`, `val_loss`,
/// `val_<metric>`, and `lr`.

#include <trainloop/error.hpp>
#include <trainloop/history.hpp>

#include <map>
#include <optional>
#include <string>

namespace trainloop {

/// @brief Whether a smaller or a larger monitored value is better.
enum class MonitorMode {
  Min,  ///< e.g. a loss
  Max   ///< e.g. an accuracy
};

/// @brief The value `monitor` names in `record`.
/// @param record the epoch's record
/// @param monitor the name of the value (see the file comment)
/// @param who the callback asking, named in the error
/// @throws trainloop::ConfigurationError listing the names the epoch measured when it has no such value.
inline double monitored_value(const EpochRecord& record, const std::string& monitor, const std::string& who) {
  auto metric = [](const std::map<std::string, double>& metrics, const std::string& name) -> std::optional<double> {
    auto it = metrics.find(name);
    if (it == metrics.end()) return std::nullopt;
    return it->second;
  };
  std::optional<double> value;
  if (monitor == "train_loss") value = record.train_loss;
  else if (monitor == "lr") value = record.learning_rate;
  else if (monitor.rfind("train_", 0) == 0) value = metric(record.train_metrics, monitor.substr(6));
  else if (monitor == "val_loss" && record.validation) value = record.validation->loss;
  else if (monitor.rfind("val_", 0) == 0 && record.validation) value = metric(record.validation->metrics, monitor.substr(4));
  if (!value) {
    std::string names = "train_loss";
    for (const auto& [name, v] : record.train_metrics) names += ", train_" + name;
    if (record.validation) {
      names += ", val_loss";
      for (const auto& [name, v] : record.validation->metrics) names += ", val_" + name;
    }
    throw ConfigurationError(detail::concat("trainloop: ", who, " monitors '", monitor, "', which epoch ", record.epoch,
                                            " did not measure; expected one of: ", names, ", lr"));
  }
  return *value;
}

/// @brief True when `value` beats `best` by more than `min_delta` in the direction of `mode`.
inline bool improves(double value, double best, MonitorMode mode, double min_delta = 0.0) {
  return mode == MonitorMode::Min ? value < best - min_delta : value > best + min_delta;
}

}  // namespace trainloop
