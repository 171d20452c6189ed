#pragma once
/// @file
/// @brief CsvLogger: writes the history as CSV, one row per epoch, replaced atomically each epoch.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/hyperparameters.hpp>

#include <filesystem>
#include <iomanip>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop {

/// @brief Writes one CSV row per finished epoch: epoch, steps, samples, train_loss, train
/// metrics, validation loss and metrics, lr, momentum (when the optimizer has one), seconds,
/// samples_per_second, data_wait_seconds. With `per_step`, also one row per optimizer step (step, epoch, lr,
/// momentum, loss of its last micro-batch on the main process) in `<name>-steps.csv` beside it.
///
/// The file is rewritten atomically after every epoch (a unique temporary file, fsynced, renamed
/// into place), so a reader (or a crash) never sees a half-written file. A path that is a
/// directory or cannot be written is a trainloop::Error when fit() begins. Runs on the main
/// process only.
class CsvLogger : public Callback {
 public:
  /// @param path the CSV file to write (its directory must exist)
  /// @param per_step also write one row per optimizer step into `<name>-steps.csv`
  explicit CsvLogger(std::filesystem::path path, bool per_step = false) : path_(std::move(path)), per_step_(per_step) {}

  /// Writes files only from the main process.
  bool main_process_only() const override { return true; }

  void on_fit_begin(TrainState&) override {
    // A path that is a directory, or in a missing or read-only directory, fails here, before
    // any training, rather than after the first epoch.
    { detail::AtomicFile probe(path_, "the CSV history file"); }
    header_.clear();
    rows_.clear();
    step_rows_.clear();
  }

  void on_step_end(TrainState& state) override {
    if (!per_step_) return;
    const auto momentum = momentum_of(*state.optimizer);
    step_rows_.push_back(std::to_string(state.global_step) + "," + std::to_string(state.epoch) + "," +
                         scientific(learning_rate_of(*state.optimizer)) + "," +
                         (momentum ? detail::fixed(*momentum, 6) : std::string()) + "," +
                         detail::fixed(state.last_loss(), 6));
  }

  void on_epoch_end(TrainState&, const EpochRecord& record) override {
    std::vector<std::string> names{"epoch", "steps", "samples", "train_loss"};
    std::vector<std::string> values{std::to_string(record.epoch), std::to_string(record.steps),
                                    std::to_string(record.samples), detail::fixed(record.train_loss, 6)};
    for (const auto& [name, value] : record.train_metrics) {
      names.push_back("train_" + name);
      values.push_back(detail::fixed(value, 6));
    }
    if (record.validation) {
      names.push_back("val_loss");
      values.push_back(detail::fixed(record.validation->loss, 6));
      for (const auto& [name, value] : record.validation->metrics) {
        names.push_back("val_" + name);
        values.push_back(detail::fixed(value, 6));
      }
    }
    names.push_back("lr");
    values.push_back(scientific(record.learning_rate));
    if (record.momentum) {
      names.push_back("momentum");
      values.push_back(detail::fixed(*record.momentum, 6));
    }
    names.insert(names.end(), {"seconds", "samples_per_second", "data_wait_seconds"});
    values.insert(values.end(), {detail::fixed(record.seconds, 3), detail::fixed(record.samples_per_second, 1),
                                 detail::fixed(record.data_wait_seconds, 3)});
    if (header_.empty()) header_ = join(names);
    rows_.push_back(join(values));
    write();
  }

  /// @brief The file written.
  const std::filesystem::path& path() const { return path_; }
  /// @brief The per-step file (written when per_step is on).
  std::filesystem::path steps_path() const {
    return path_.parent_path() / (path_.stem().string() + "-steps" + path_.extension().string());
  }

 private:
  static std::string scientific(double value) {
    std::ostringstream out;
    out << std::setprecision(6) << std::scientific << value;
    return out.str();
  }
  static std::string join(const std::vector<std::string>& cells) {
    std::string line;
    for (size_t i = 0; i < cells.size(); ++i) line += (i ? "," : "") + cells[i];
    return line;
  }
  void write() const {
    std::string text = header_ + '\n';
    for (const auto& row : rows_) text += row + '\n';
    detail::write_file_atomically(path_, text, "the CSV history file");
    if (!per_step_) return;
    std::string steps = "step,epoch,lr,momentum,loss\n";
    for (const auto& row : step_rows_) steps += row + '\n';
    detail::write_file_atomically(steps_path(), steps, "the CSV step history file");
  }

  std::filesystem::path path_;
  std::string header_;
  std::vector<std::string> rows_;
  bool per_step_ = false;
  std::vector<std::string> step_rows_;
};

}  // namespace trainloop
