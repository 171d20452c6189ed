#pragma once
/// @file
/// @brief Elastic training (elastic_fit.hpp): the hand-off a process resumed from last, kept until
/// no loss can need it again.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/distributed/elastic/step_committer.hpp>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <system_error>

namespace trainloop::distributed::elastic {

/// @brief The hand-off this process resumed from last, kept while a second loss may need it: the
/// survivors of that loss resume from it again instead of starting the fit again from its start.
/// A replicated hand-off (a file) until the next commit: the loop's state is that step's until then.
/// A sharded one (this machine's copy of a per-rank checkpoint's directory) until the second commit
/// after it: a step's copies of the shards are taken at the next step's start (share_copies.hpp), so
/// the first step after the hand-off is in every survivor's copies only once a rank committed the
/// step after that (which every rank enters after its copies of the first). Removed then, when the
/// fit ends, and by the launcher when the process is killed; a directory only by the rank holding it
/// for its machine.
class PendingHandOff {
 public:
  PendingHandOff() = default;
  PendingHandOff(const PendingHandOff&) = delete;
  PendingHandOff& operator=(const PendingHandOff&) = delete;
  /// Removes it, but a directory while an error unwinds: this rank may be one the others judged
  /// lost (on another machine, slow) while they read its machine's copy; the launcher removes it.
  ~PendingHandOff() {
    if (sharded_ && std::uncaught_exceptions() > 0) removes_ = false;
    drop();
  }

  /// The step it holds; -1 when there is none.
  std::int64_t step() const { return step_; }
  /// Its file, or its directory (sharded state).
  const std::filesystem::path& path() const { return path_; }
  /// Whether it is a sharded hand-off (a directory).
  bool sharded() const { return sharded_; }
  /// A sharded hand-off is removed by the rank `holds` says holds it for its machine (after a loss,
  /// each machine's lowest survivor holding it: its remover may be the rank lost).
  void held_for_machine(bool holds) {
    if (sharded_) removes_ = holds;
  }
  /// Whether it holds the loop's state alone, the model and optimizer kept in memory
  /// (ResumeSpec::keeps_model_and_optimizer).
  bool keeps_model_and_optimizer() const { return keeps_model_and_optimizer_; }

  /// `next` resumes from a hand-off of step `step`, one file or one directory: it is kept (not
  /// removed once loaded) as the class comment says; `next.removes_directory` says whether this
  /// rank removes a directory then (unset: as it did, when it is the directory kept already).
  /// Anything else is not kept.
  void keep(::trainloop::detail::ResumeSpec& next, std::int64_t step, StepCommitter& commits) {
    std::error_code error;
    const bool file = next.candidates.size() == 1 && std::filesystem::is_regular_file(next.candidates.front(), error);
    const bool directory = next.candidates.size() == 1 && !file && std::filesystem::is_directory(next.candidates.front(), error);
    if (!file && !directory) {
      drop();
      return;
    }
    const bool same = next.candidates.front() == path_;
    const bool removed_it = same && removes_;
    if (!same) drop();
    path_ = next.candidates.front();
    step_ = step;
    sharded_ = directory;
    removes_ = file || next.removes_directory.value_or(removed_it);
    next.consume = false;  // kept here instead
    keeps_model_and_optimizer_ = next.keeps_model_and_optimizer;
    if (file) {
      commits.after_next_commit([this] { drop(); });
    } else {
      commits.after_next_commit([this, &commits] { commits.after_next_commit([this] { drop(); }); });
    }
  }

  /// Removes it (nothing when there is none; a directory another rank holds for its machine is only forgotten).
  void drop() {
    if (path_.empty()) return;
    std::error_code ignored;  // gone already: nothing to report
    if (removes_) std::filesystem::remove_all(path_, ignored);
    path_.clear();
    step_ = -1;
    sharded_ = false;
    removes_ = false;
    keeps_model_and_optimizer_ = false;
  }

 private:
  std::filesystem::path path_;
  std::int64_t step_ = -1;
  bool sharded_ = false;
  bool removes_ = false;  // this rank removes it (a file: always; a directory: its machine's holder)
  bool keeps_model_and_optimizer_ = false;
};

}  // namespace trainloop::distributed::elastic
