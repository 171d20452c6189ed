#pragma once
/// @file
/// @brief ModelCheckpoint: writes checkpoints every N epochs, N steps and/or T minutes, keeps the
/// last K and the best K by a monitored value, and keeps `last.ckpt` pointing at the newest.
///
/// @code
/// auto checkpoints = std::make_shared<trainloop::ModelCheckpoint>(
///     trainloop::ModelCheckpointOptions("runs/ckpt").every_n_epochs(1).keep_last(2)
///         .monitor("val_accuracy").mode(trainloop::MonitorMode::Max).keep_best(1));
/// loop.fit(10, {checkpoints}, "last");   // resumes from runs/ckpt/last.ckpt when there is one
/// @endcode
///
/// Files: `epoch=0003-step=000120.ckpt` (periodic), `best-epoch=0003-val_accuracy=0.9123.ckpt`
/// (best K), `last.ckpt` (a symbolic link to the newest, replaced atomically). Every file is a
/// complete checkpoint written by rank 0 only, atomically (checkpoint/checkpoint_file.hpp), and
/// loadable in any mode and world size, or by a plain libtorch program (`torch::load(model, f)`).
/// A checkpoint that cannot be written (disk full, read-only directory) stops training with an
/// error naming the path, unless stop_on_error(false) (then it is reported and training goes on).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/monitor.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <system_error>
#include <unistd.h>
#include <utility>
#include <vector>

namespace trainloop {


/// @brief The checkpoints in `directory`, newest first: `last.ckpt` (when it exists), then the
/// other `*.ckpt` files by the step, then the epoch, in their names.
inline std::vector<std::filesystem::path> checkpoint_candidates(const std::filesystem::path& directory) {
  auto number_after = [](const std::string& name, const std::string& key) -> int64_t {
    const auto at = name.find(key);
    return at == std::string::npos ? -1 : std::strtoll(name.c_str() + at + key.size(), nullptr, 10);
  };
  std::vector<std::pair<std::pair<int64_t, int64_t>, std::filesystem::path>> found;
  std::error_code error;
  for (std::filesystem::directory_iterator it(directory, error), end; !error && it != end; it.increment(error)) {
    const std::string name = it->path().filename().string();
    if (name == "last.ckpt" || it->path().extension() != ".ckpt" || name.find(".tmp.") != std::string::npos) continue;
    found.push_back({{number_after(name, "step="), number_after(name, "epoch=")}, it->path()});
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<std::filesystem::path> paths;
  if (std::filesystem::exists(directory / "last.ckpt")) paths.push_back(directory / "last.ckpt");
  for (const auto& entry : found) paths.push_back(entry.second);
  return paths;
}

/// @brief Options of ModelCheckpoint; only the directory is required.
struct ModelCheckpointOptions {
  /// @param directory where the checkpoints go (created if missing)
  explicit ModelCheckpointOptions(std::filesystem::path directory) : directory_(std::move(directory)) {}
  /// Directory of the checkpoints.
  TORCH_ARG(std::filesystem::path, directory);
  /// Write one at the end of every N-th epoch; 0: not by epoch.
  TORCH_ARG(int64_t, every_n_epochs) = 1;
  /// Write one after every N-th optimizer step (inside epochs too); 0: not by step.
  TORCH_ARG(int64_t, every_n_steps) = 0;
  /// Write one when this many minutes passed since the last one (checked after every step); 0: not by time.
  TORCH_ARG(double, every_minutes) = 0.0;
  /// Periodic checkpoints kept (the newest); 0 keeps all.
  TORCH_ARG(int64_t, keep_last) = 1;
  /// The value that ranks checkpoints for keep_best: "val_loss", "val_<metric>", "train_loss",
  /// "train_<metric>" (e.g. "val_accuracy"). Empty: no best checkpoints.
  TORCH_ARG(std::string, monitor) = "";
  /// Whether smaller or larger values of `monitor` are better.
  TORCH_ARG(MonitorMode, mode) = MonitorMode::Min;
  /// Best checkpoints kept (by `monitor`, checked at the end of every epoch); 0: none.
  TORCH_ARG(int64_t, keep_best) = 1;
  /// A checkpoint that cannot be written stops training (true) or is reported and skipped (false).
  TORCH_ARG(bool, stop_on_error) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::ConfigurationError naming the first option out of range.
  void validate() const {
    TRAINLOOP_CHECK(!directory_.empty(), "the checkpoint directory is empty; expected a path");
    TRAINLOOP_CHECK(every_n_epochs_ >= 0 && every_n_steps_ >= 0 && every_minutes_ >= 0.0,
                    "checkpoint intervals are every ", every_n_epochs_, " epochs, ", every_n_steps_, " steps, ",
                    every_minutes_, " minutes; expected 0 (off) or positive values");
    TRAINLOOP_CHECK(keep_last_ >= 0 && keep_best_ >= 0, "keep_last is ", keep_last_, " and keep_best ", keep_best_,
                    "; expected 0 or more");
  }
};

/// @brief Writes checkpoints during fit() (see checkpoint/checkpoint_file.hpp for what is in one).
class ModelCheckpoint : public Callback {
 public:
  /// @brief A checkpoint callback with `options` (checked here).
  explicit ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) { options_.validate(); }

  /// @brief The directory written to.
  const std::filesystem::path& directory() const { return options_.directory(); }
  /// @brief `directory()/last.ckpt`.
  std::filesystem::path last_path() const { return directory() / "last.ckpt"; }

  /// @brief Checkpoints in the directory, newest first (see checkpoint_candidates()): what
  /// resuming from "last" tries, in order, when one is unreadable.
  std::vector<std::filesystem::path> candidates() const { return checkpoint_candidates(directory()); }

  /// @brief The best checkpoints kept so far, best first: (monitored value, file).
  const std::vector<std::pair<double, std::filesystem::path>>& best() const { return best_; }
  /// @brief The periodic checkpoints kept so far, oldest first.
  const std::vector<std::filesystem::path>& recent() const { return recent_; }

  /// @brief True: its checkpoints hold the other callbacks' state after the same event.
  bool runs_after_others() const override { return true; }

  void on_fit_begin(TrainState& state) override {
    if (state.is_main) {
      std::error_code error;
      std::filesystem::create_directories(directory(), error);
      TRAINLOOP_CHECK(!error && std::filesystem::is_directory(directory()), "cannot create the checkpoint directory ",
                      directory().string(), " (", error.message(), "); expected a writable location");
    }
    last_save_ = std::chrono::steady_clock::now();
  }

  void on_step_end(TrainState& state) override {
    bool due = options_.every_n_steps() > 0 && state.global_step % options_.every_n_steps() == 0;
    if (options_.every_minutes() > 0.0) {
      const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save_).count() / 60.0;
      // Clocks differ between ranks: a checkpoint is a collective, so all take it if any is due.
      due = state.any_rank(due || minutes >= options_.every_minutes());
    }
    if (due) save_periodic(state);
  }

  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    std::optional<std::filesystem::path> written;
    if (options_.every_n_epochs() > 0 && state.epoch % options_.every_n_epochs() == 0) written = save_periodic(state);
    if (options_.monitor().empty() || options_.keep_best() == 0) return;
    const double value = monitored_value(record);
    if (!std::isfinite(value) || !qualifies(value)) return;
    std::ostringstream name;
    name << "best-epoch=" << std::setw(4) << std::setfill('0') << state.epoch << '-' << options_.monitor() << '='
         << std::fixed << std::setprecision(4) << value << ".ckpt";
    const std::filesystem::path path = directory() / name.str();
    if (!save(state, path, written)) return;
    best_.emplace_back(value, path);
    std::stable_sort(best_.begin(), best_.end(), [&](const auto& a, const auto& b) { return better(a.first, b.first); });
    while (static_cast<int64_t>(best_.size()) > options_.keep_best()) {
      remove_file(state, best_.back().second);
      best_.pop_back();
    }
  }

  void save_state(torch::serialize::OutputArchive& archive) const override {
    std::ostringstream text;
    text << std::setprecision(std::numeric_limits<double>::max_digits10);
    for (const auto& [value, path] : best_) text << "best\t" << value << '\t' << path.string() << '\n';
    for (const auto& path : recent_) text << "recent\t0\t" << path.string() << '\n';
    archive.write("files", c10::IValue(text.str()));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    c10::IValue files;
    if (!archive.try_read("files", files)) return;
    best_.clear();
    recent_.clear();
    std::istringstream in(files.toStringRef());
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string kind, value, path;
      std::getline(fields, kind, '\t');
      std::getline(fields, value, '\t');
      std::getline(fields, path);
      if (kind == "best") best_.emplace_back(std::stod(value), path);
      if (kind == "recent") recent_.emplace_back(path);
    }
  }

 private:
  bool better(double a, double b) const { return improves(a, b, options_.mode()); }

  bool qualifies(double value) const {
    return static_cast<int64_t>(best_.size()) < options_.keep_best() || better(value, best_.back().first);
  }

  double monitored_value(const EpochRecord& record) const {
    return trainloop::monitored_value(record, options_.monitor(), "ModelCheckpoint");
  }

  std::optional<std::filesystem::path> save_periodic(TrainState& state) {
    std::ostringstream name;
    name << "epoch=" << std::setw(4) << std::setfill('0') << state.epoch << "-step=" << std::setw(6) << state.global_step
         << ".ckpt";
    const std::filesystem::path path = directory() / name.str();
    if (!save(state, path, std::nullopt)) return std::nullopt;
    if (std::find(recent_.begin(), recent_.end(), path) == recent_.end()) recent_.push_back(path);
    while (options_.keep_last() > 0 && static_cast<int64_t>(recent_.size()) > options_.keep_last()) {
      remove_file(state, recent_.front());
      recent_.erase(recent_.begin());
    }
    return path;
  }

  /// Writes `path` (a collective), or hard-links `same_state` (a checkpoint of this very
  /// position written just before) to it; then points last.ckpt at it. False when the write
  /// failed and stop_on_error is off.
  bool save(TrainState& state, const std::filesystem::path& path, const std::optional<std::filesystem::path>& same_state) {
    try {
      if (same_state) {
        if (state.is_main) link_atomically(*same_state, path);
      } else {
        state.save_checkpoint(path);
      }
    } catch (const Error& error) {
      if (options_.stop_on_error()) throw;
      if (state.is_main) std::cerr << error.what() << " (ModelCheckpoint: stop_on_error is off; training goes on)\n";
      return false;
    }
    last_save_ = std::chrono::steady_clock::now();
    // A second name of the state just written leaves last.ckpt pointing at the first.
    if (state.is_main && !same_state) point_last_at(path);
    return true;
  }

  /// Makes `link` a second name of `target`, atomically (a hard link under a temporary name, renamed).
  static void link_atomically(const std::filesystem::path& target, const std::filesystem::path& link) {
    const std::filesystem::path temporary = link.string() + ".tmp." + std::to_string(::getpid());
    std::error_code error;
    std::filesystem::remove(temporary, error);
    std::filesystem::create_hard_link(target, temporary, error);
    if (error) std::filesystem::copy_file(target, temporary, std::filesystem::copy_options::overwrite_existing, error);
    if (!error) std::filesystem::rename(temporary, link, error);
    if (error) {
      throw Error(detail::concat("trainloop: cannot write the checkpoint ", link.string(), ": ", error.message(),
                                 "; expected a writable directory with free space"));
    }
    detail::sync_directory(link.parent_path());
  }

  /// Replaces last.ckpt by a symbolic link to `path`, atomically (a new link renamed over it).
  void point_last_at(const std::filesystem::path& path) const {
    const std::filesystem::path temporary = last_path().string() + ".tmp." + std::to_string(::getpid());
    std::error_code error;
    std::filesystem::remove(temporary, error);
    std::filesystem::create_symlink(path.filename(), temporary, error);
    if (!error) std::filesystem::rename(temporary, last_path(), error);
    if (error) {
      std::cerr << "trainloop: cannot point " << last_path().string() << " at " << path.string() << ": "
                << error.message() << '\n';
      return;
    }
    detail::sync_directory(directory());
  }

  void remove_file(const TrainState& state, const std::filesystem::path& path) const {
    if (!state.is_main) return;
    std::error_code error;
    // Never the file last.ckpt points at (a best checkpoint can be the newest too).
    if (std::filesystem::equivalent(path, last_path(), error)) return;
    std::filesystem::remove(path, error);
  }

  ModelCheckpointOptions options_;
  std::vector<std::pair<double, std::filesystem::path>> best_;
  std::vector<std::filesystem::path> recent_;
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();
};

}  // namespace trainloop
