#pragma once
/// @file
/// @brief ProgressBar: live progress on a terminal, one plain line per epoch elsewhere.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/format.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>

namespace trainloop {

/// @brief Shows loss, metrics, samples/s and the time left.
///
/// On a terminal the current epoch's line is redrawn in place (at most `refresh_seconds` apart,
/// because reading the running loss waits for the device); when the output is a file or a pipe,
/// only the finished epochs are printed, one line each. Runs on the main process only.
class ProgressBar : public Callback {
 public:
  /// @param out where to print (std::cout by default)
  /// @param interactive redraw in place; by default, when `out` is std::cout and stdout is a terminal
  /// @param refresh_seconds the shortest time between two redraws
  explicit ProgressBar(std::ostream& out = std::cout, std::optional<bool> interactive = std::nullopt,
                       double refresh_seconds = 0.2)
      : out_(out),
        interactive_(interactive.value_or(&out == &std::cout && ::isatty(STDOUT_FILENO) == 1)),
        refresh_seconds_(refresh_seconds) {}

  /// Prints the bar only from the main process.
  bool main_process_only() const override { return true; }

  void on_epoch_begin(TrainState&) override { last_draw_ = -1e9; }

  void on_batch_end(TrainState& state) override {
    if (!interactive_) return;
    if (state.epoch_seconds - last_draw_ < refresh_seconds_ && state.batch < state.batches_per_epoch) return;
    last_draw_ = state.epoch_seconds;
    std::ostringstream line;
    line << '\r' << epoch_label(state) << ' ' << bar(state.batch, state.batches_per_epoch) << ' ' << state.batch << '/'
         << state.batches_per_epoch << " loss " << detail::fixed(state.running_loss ? state.running_loss() : 0.0, 4)
         << ' ' << detail::fixed(rate(state), 0) << " samples/s eta " << detail::duration(time_left(state)) << "   ";
    out_ << line.str() << std::flush;
  }

  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    std::ostringstream line;
    if (interactive_) line << '\r';
    line << epoch_label(state) << " train_loss " << detail::fixed(record.train_loss, 4);
    for (const auto& [name, value] : record.train_metrics) line << ' ' << name << ' ' << detail::fixed(value, 4);
    if (record.validation) {
      line << " val_loss " << detail::fixed(record.validation->loss, 4);
      for (const auto& [name, value] : record.validation->metrics)
        line << " val_" << name << ' ' << detail::fixed(value, 4);
    }
    line << ' ' << detail::fixed(record.samples_per_second, 0) << " samples/s " << detail::fixed(record.seconds, 1)
         << "s eta " << detail::duration(time_left(state));
    // Named only when the loader, not the model, costs time worth a look (the goal is < 5%).
    if (record.seconds > 0 && record.data_wait_seconds > 0.01 * record.seconds)
      line << " (waited for data " << detail::fixed(100.0 * record.data_wait_seconds / record.seconds, 0) << "%)";
    out_ << line.str() << (interactive_ ? "\x1b[K\n" : "\n") << std::flush;
  }

 private:
  static std::string epoch_label(const TrainState& state) {
    return "epoch " + std::to_string(state.epoch) + "/" + std::to_string(state.planned_epochs);
  }
  static std::string bar(int64_t done, int64_t total) {
    constexpr size_t width = 24;
    const auto filled = static_cast<size_t>(std::clamp<int64_t>(total > 0 ? 24 * done / total : 24, 0, 24));
    std::string text(width + 2, ' ');
    text.front() = '[';
    text.back() = ']';
    std::fill_n(text.begin() + 1, filled, '=');
    return text;
  }
  static double rate(const TrainState& state) {
    return state.epoch_seconds > 0 ? static_cast<double>(state.epoch_samples) / state.epoch_seconds : 0.0;
  }
  /// Time left for the whole fit, from the pace of the micro-batches done so far.
  static double time_left(const TrainState& state) {
    const int64_t done = (state.epoch - state.first_epoch) * state.batches_per_epoch + state.batch;
    const int64_t total = (state.planned_epochs - state.first_epoch + 1) * state.batches_per_epoch;
    if (done <= 0) return 0.0;
    return state.fit_seconds / static_cast<double>(done) * static_cast<double>(std::max<int64_t>(total - done, 0));
  }

  std::ostream& out_;
  bool interactive_;
  double refresh_seconds_;
  double last_draw_ = -1e9;
};

namespace detail {

/// `callbacks` with a ProgressBar added when `progress` asks for one (by default: standard output
/// is a terminal) and none is among them already.
inline CallbackList with_default_progress(const CallbackList& callbacks, std::optional<bool> progress) {
  if (!progress.value_or(::isatty(STDOUT_FILENO) == 1)) return callbacks;
  for (const auto& callback : callbacks) {
    if (dynamic_cast<const ProgressBar*>(callback.get()) != nullptr) return callbacks;
  }
  CallbackList with_bar = callbacks;
  with_bar.push_back(std::make_shared<ProgressBar>());
  return with_bar;
}

}  // namespace detail

}  // namespace trainloop
