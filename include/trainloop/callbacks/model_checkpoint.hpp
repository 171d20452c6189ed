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
/// (best K), `last.ckpt` (a symbolic link to the newest, replaced atomically). Every one is a
/// complete checkpoint, written atomically and loadable in any mode and world size: a file written
/// by rank 0 (checkpoint/checkpoint_file.hpp; a plain libtorch program reads it with
/// `torch::load(model, f)`), or, from a sharded mode, a directory every rank wrote its share into
/// (torch.distributed.checkpoint's layout: checkpoint/dcp_checkpoint.hpp; Python's `dcp.load` reads it).
/// A checkpoint that cannot be written (disk full, read-only directory) stops training with an
/// error naming the path, unless stop_on_error(false) (then it is reported and training goes on).

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/callbacks/model_checkpoint_options.hpp>
#include <trainloop/callbacks/monitor.hpp>
#include <trainloop/checkpoint/checkpoint_names.hpp>
#include <trainloop/checkpoint/checkpoint_source.hpp>
#include <trainloop/detail/atomic_directory.hpp>
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


/// @brief Writes checkpoints during fit() (see checkpoint/checkpoint_file.hpp for what is in one).
///
/// **Which files it removes.** Only files it wrote, in its own directory: the keep_last and
/// keep_best lists hold file names (never paths), each removal is `directory()/name` after the
/// name was checked against its own patterns (`epoch=...-step=....ckpt`, `best-epoch=...-<monitor>=....ckpt`),
/// and the file `last.ckpt` points at is never removed. A checkpoint of another run that a fit
/// resumes or fine-tunes from is only read: its directory is never written to.
///
/// **Across resumes, kills and directory changes.** Every checkpoint records the lists as they
/// are once that very file is added (and the files it makes surplus), so the file a run resumes
/// from is tracked and keep_last / keep_best / best() hold after any number of resumes. On
/// restore, names whose file is not in this callback's directory are dropped (a checkpoint of
/// another directory, fine-tuned from); names that are there are tracked (a copied run
/// directory). When fit() begins, the files an interrupted write had made surplus are removed,
/// `last.ckpt` is pointed at the newest tracked checkpoint, and temporaries of writers that were
/// killed are removed (detail/atomic_file.hpp).
class ModelCheckpoint : public Callback, public CheckpointSource {
 public:
  /// @brief A checkpoint callback with `options` (checked here).
  explicit ModelCheckpoint(ModelCheckpointOptions options) : options_(std::move(options)) { options_.validate(); }

  /// @brief The directory written to.
  const std::filesystem::path& directory() const { return options_.directory(); }
  /// @brief `directory()/last.ckpt`.
  std::filesystem::path last_path() const override { return directory() / kLastCheckpointName; }

  /// @brief Checkpoints in the directory, newest first (see checkpoint_candidates()): what
  /// resuming from "last" tries, in order, when one is unreadable.
  std::vector<std::filesystem::path> candidates() const override { return checkpoint_candidates(directory()); }

  /// @brief The best checkpoints kept so far, best first: (monitored value, file). Kept by the
  /// main process (the one that writes); other ranks may hold fewer after a restore.
  std::vector<std::pair<double, std::filesystem::path>> best() const {
    std::vector<std::pair<double, std::filesystem::path>> paths;
    for (const auto& [value, name] : files_.best) paths.emplace_back(value, directory() / name);
    return paths;
  }
  /// @brief The periodic checkpoints kept so far, oldest first.
  std::vector<std::filesystem::path> recent() const {
    std::vector<std::filesystem::path> paths;
    for (const auto& name : files_.recent) paths.push_back(directory() / name);
    return paths;
  }

  /// @brief How each checkpoint of this callback ended, oldest first: its error (null when it was
  /// committed), whether it was written behind training, the seconds the training thread waited
  /// for it and the seconds until it was committed (every rank keeps its own).
  const std::vector<CheckpointReport>& reports() const { return reports_; }

  /// @brief True: its checkpoints hold the other callbacks' state after the same event.
  bool runs_after_others() const override { return true; }

  void on_fit_begin(TrainState& state) override {
    if (state.is_main) {
      std::error_code error;
      std::filesystem::create_directories(directory(), error);
      TRAINLOOP_CHECK(!error && std::filesystem::is_directory(directory()), "cannot create the checkpoint directory ",
                      directory().string(), " (", error.message(), "); expected a writable location");
      tidy_up();
    }
    files_.surplus.clear();
    last_save_ = std::chrono::steady_clock::now();
  }

  void on_step_end(TrainState& state) override {
    bool due = options_.every_n_steps() > 0 && state.global_step % options_.every_n_steps() == 0;
    if (options_.every_minutes() > 0.0) {
      const double minutes = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_save_).count() / 60.0;
      // Clocks differ between ranks: a checkpoint is a collective, so all take it if any is due.
      due = state.any_rank(due || minutes >= options_.every_minutes());
    }
    if (due) save(state, periodic_checkpoint_name(state.epoch, state.global_step), std::nullopt);
  }

  void on_epoch_end(TrainState& state, const EpochRecord& record) override {
    std::optional<std::string> periodic;
    if (options_.every_n_epochs() > 0 && state.epoch % options_.every_n_epochs() == 0) {
      periodic = periodic_checkpoint_name(state.epoch, state.global_step);
    }
    std::optional<std::pair<double, std::string>> best;
    // A checkpoint still written behind training ends first: the best list it adds to decides.
    const bool may_write = periodic || (!options_.monitor().empty() && options_.keep_best() > 0);
    if (may_write && options_.in_background() && state.wait_for_checkpoints) state.wait_for_checkpoints();
    if (!options_.monitor().empty() && options_.keep_best() > 0) {
      const double value = trainloop::monitored_value(record, options_.monitor(), "ModelCheckpoint");
      // The main process's lists decide (a restore on another machine may not see its files);
      // writing is a collective, so every rank follows that decision.
      if (state.any_rank(state.is_main && std::isfinite(value) && qualifies(value))) {
        best.emplace(value, best_checkpoint_name(state.epoch, options_.monitor(), value));
      }
    }
    if (periodic || best) save(state, periodic, best);
  }

  /// @brief Optional: a ModelCheckpoint in a new directory (fine-tuning from a checkpoint written
  /// elsewhere) starts with no files tracked.
  bool state_optional() const override { return true; }
  void save_state(torch::serialize::OutputArchive& archive) const override {
    // Inside save(): the lists as they are once the file being written is added.
    const Files& files = planned_ ? *planned_ : files_;
    std::ostringstream text;
    text << std::setprecision(std::numeric_limits<double>::max_digits10);
    for (const auto& [value, name] : files.best) text << "best\t" << value << '\t' << name << '\n';
    for (const auto& name : files.recent) text << "recent\t0\t" << name << '\n';
    for (const auto& name : files.surplus) text << "surplus\t0\t" << name << '\n';
    archive.write("files", c10::IValue(text.str()));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    c10::IValue stored;
    if (!archive.try_read("files", stored)) return;
    Files files;
    std::istringstream in(stored.toStringRef());
    std::string line;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string kind, value, recorded;
      std::getline(fields, kind, '\t');
      std::getline(fields, value, '\t');
      std::getline(fields, recorded);
      // Older checkpoints recorded paths: only the name counts, and only in this directory.
      const std::string name = std::filesystem::path(recorded).filename().string();
      if (!is_own_file_name(name) || !own_file_exists(name)) continue;
      if (kind == "best") files.best.emplace_back(std::stod(value), name);
      if (kind == "recent") files.recent.push_back(name);
      if (kind == "surplus") files.surplus.push_back(name);
    }
    std::stable_sort(files.best.begin(), files.best.end(),
                     [&](const auto& a, const auto& b) { return better(a.first, b.first); });
    files_ = std::move(files);
  }

 private:
  /// The files this callback tracks, by name in its directory.
  struct Files {
    std::vector<std::pair<double, std::string>> best;  ///< best first
    std::vector<std::string> recent;                   ///< oldest first
    std::vector<std::string> surplus;                  ///< made surplus by the newest write, to remove
  };

  bool better(double a, double b) const { return improves(a, b, options_.mode()); }

  bool qualifies(double value) const {
    return static_cast<int64_t>(files_.best.size()) < options_.keep_best() || better(value, files_.best.back().first);
  }

  /// True for a name this callback writes: a periodic checkpoint, or a best one of its monitor.
  bool is_own_file_name(const std::string& name) const {
    const auto position = parse_checkpoint_name(name, options_.monitor());
    return position && (!position->best || !options_.monitor().empty());
  }
  bool own_file_exists(const std::string& name) const {
    std::error_code ignored;
    const auto status = std::filesystem::symlink_status(directory() / name, ignored);
    // A directory: a per-rank checkpoint (torch.distributed.checkpoint's layout, sharded modes).
    return std::filesystem::is_regular_file(status) || std::filesystem::is_directory(status);
  }

  /// Writes the periodic and/or best checkpoint of this moment (a collective): one file, and the
  /// other as a second name of it; then points last.ckpt at it and removes what the keep limits
  /// made surplus. A per-rank checkpoint is written behind training (in_background) and finished
  /// at the step boundary where the ranks agree it ended. A failed write changes nothing (and
  /// throws unless stop_on_error is off).
  void save(TrainState& state, const std::optional<std::string>& periodic,
            const std::optional<std::pair<double, std::string>>& best) {
    const bool background = options_.in_background() && state.start_checkpoint && state.wait_for_checkpoints;
    if (background) state.wait_for_checkpoints();  // the one in flight ends first: its file is in the lists
    Files plan = files_;
    plan.surplus.clear();
    if (periodic) {
      if (std::find(plan.recent.begin(), plan.recent.end(), *periodic) == plan.recent.end()) plan.recent.push_back(*periodic);
      while (options_.keep_last() > 0 && static_cast<int64_t>(plan.recent.size()) > options_.keep_last()) {
        plan.surplus.push_back(plan.recent.front());
        plan.recent.erase(plan.recent.begin());
      }
    }
    if (best) {
      std::erase_if(plan.best, [&](const auto& entry) { return entry.second == best->second; });
      plan.best.push_back(*best);
      std::stable_sort(plan.best.begin(), plan.best.end(),
                       [&](const auto& a, const auto& b) { return better(a.first, b.first); });
      while (static_cast<int64_t>(plan.best.size()) > options_.keep_best()) {
        plan.surplus.push_back(plan.best.back().second);
        plan.best.pop_back();
      }
    }
    const std::string written = periodic ? *periodic : best->second;
    planned_ = plan;  // what save_state() records in the file
    struct ForgetPlan {
      std::optional<Files>& plan;
      ~ForgetPlan() { plan.reset(); }
    } forget{planned_};
    const std::optional<std::string> best_name = best ? std::optional<std::string>(best->second) : std::nullopt;
    if (background) {
      last_save_ = std::chrono::steady_clock::now();  // every_minutes counts from the start, not the commit
      state.start_checkpoint(directory() / written, [this, &state, plan, written, linked = periodic ? best_name : std::nullopt](
                                                        const CheckpointReport& report) {
        finish(state, plan, written, linked, report);
      });
      return;
    }
    CheckpointReport report{directory() / written, nullptr, false, 0.0, 0.0};
    const auto start = std::chrono::steady_clock::now();
    try {
      state.save_checkpoint(directory() / written);
    } catch (const Error&) {
      report.error = std::current_exception();
    }
    report.blocked_seconds = report.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    finish(state, std::move(plan), written, periodic ? best_name : std::nullopt, report);
  }

  /// After the checkpoint `written` ended (every rank, at the same point): on success, its second
  /// name `linked` (a best checkpoint that is also periodic), last.ckpt, the keep limits.
  void finish(TrainState& state, Files plan, const std::string& written, const std::optional<std::string>& linked,
              const CheckpointReport& report) {
    reports_.push_back(report);
    try {
      if (report.error) std::rethrow_exception(report.error);
      if (linked) {
        // The same state under its best name (a hard link); every rank learns whether it worked.
        std::string failure;
        if (state.is_main) {
          try {
            detail::link_atomically(directory() / written, directory() / *linked);
          } catch (const Error& error) {
            failure = error.what();
          }
        }
        if (state.any_rank(!failure.empty())) {
          throw CheckpointError(failure.empty() ? detail::concat("trainloop: another rank could not write the checkpoint ",
                                                                 (directory() / *linked).string(),
                                                                 " (its error names the cause)")
                                                : failure);
        }
      }
    } catch (const Error& error) {
      if (options_.stop_on_error()) throw;
      if (state.is_main) std::cerr << error.what() << " (ModelCheckpoint: stop_on_error is off; training goes on)\n";
      return;
    }
    last_save_ = std::chrono::steady_clock::now();
    files_ = std::move(plan);
    if (state.is_main) {
      point_last_at(written);
      for (const auto& name : files_.surplus) remove_own_file(name);
    }
    files_.surplus.clear();
  }

  /// On fit begin, after a restore: finishes what an interrupted save left (see the class
  /// comment). on_fit_begin clears the surplus list afterwards, on every rank.
  void tidy_up() {
    detail::remove_dead_temporaries(directory());  // every fit: writers may have died since the last
    std::optional<std::pair<CheckpointPosition, std::string>> newest;
    auto consider = [&](const std::string& name) {
      const auto position = parse_checkpoint_name(name);
      if (position && (!newest || newer(*position, newest->first))) newest.emplace(*position, name);
    };
    for (const auto& name : files_.recent) consider(name);
    for (const auto& entry : files_.best) consider(entry.second);
    if (newest) {
      std::error_code error;
      if (!std::filesystem::equivalent(last_path(), directory() / newest->second, error)) point_last_at(newest->second);
    }
    for (const auto& name : files_.surplus) {
      const bool tracked = std::find(files_.recent.begin(), files_.recent.end(), name) != files_.recent.end() ||
                           std::any_of(files_.best.begin(), files_.best.end(), [&](const auto& e) { return e.second == name; });
      if (!tracked) remove_own_file(name);
    }
  }

  /// Replaces last.ckpt by a symbolic link to the file `name`, atomically; a failure is said, not thrown.
  void point_last_at(const std::string& name) const {
    if (const std::error_code error = detail::symlink_atomically(name, last_path())) {
      std::cerr << "trainloop: cannot point " << last_path().string() << " at " << name << ": " << error.message() << '\n';
    }
  }

  /// Removes `directory()/name` when it is one of this callback's own files (name checked against
  /// its patterns, a file or a per-rank checkpoint directory, not what last.ckpt points at). Main process only.
  void remove_own_file(const std::string& name) const {
    if (name != std::filesystem::path(name).filename().string() || !is_own_file_name(name) || !own_file_exists(name)) return;
    const std::filesystem::path path = directory() / name;
    std::error_code error;
    if (std::filesystem::equivalent(path, last_path(), error)) return;
    std::filesystem::remove_all(path, error);  // a file, or a per-rank checkpoint's directory
  }

  ModelCheckpointOptions options_;
  Files files_;
  std::optional<Files> planned_;  // during save(): the lists including the file being written
  std::vector<CheckpointReport> reports_;
  std::chrono::steady_clock::time_point last_save_ = std::chrono::steady_clock::now();
};

}  // namespace trainloop
