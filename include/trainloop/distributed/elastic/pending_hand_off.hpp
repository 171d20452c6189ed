#pragma once
/// @file
/// @brief Elastic training (elastic_fit.hpp): the replicated hand-off a process resumed from last,
/// kept until the next step is committed.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/distributed/elastic/step_committer.hpp>

#include <cstdint>
#include <filesystem>
#include <system_error>

namespace trainloop::distributed::elastic {

/// @brief The replicated hand-off this process resumed from last, kept until the next commit: a
/// second loss before that commit resumes from it again, since the loop's state is still that
/// step's (without it the survivors would start the fit again from its start). Removed after that
/// commit, when the fit ends, and by the launcher when the process is killed.
class PendingHandOff {
 public:
  PendingHandOff() = default;
  PendingHandOff(const PendingHandOff&) = delete;
  PendingHandOff& operator=(const PendingHandOff&) = delete;
  ~PendingHandOff() { drop(); }

  /// The step it holds; -1 when there is none.
  std::int64_t step() const { return step_; }
  /// Its file.
  const std::filesystem::path& path() const { return path_; }
  /// Whether it holds the loop's state alone, the model and optimizer kept in memory
  /// (ResumeSpec::keeps_model_and_optimizer).
  bool keeps_model_and_optimizer() const { return keeps_model_and_optimizer_; }

  /// `next` resumes from a replicated hand-off of step `step` (one file): it is kept (not removed
  /// once loaded) until `commits`' next commit. A sharded hand-off (a directory) is not kept.
  void keep(::trainloop::detail::ResumeSpec& next, std::int64_t step, StepCommitter& commits) {
    std::error_code error;
    if (next.candidates.size() != 1 || !std::filesystem::is_regular_file(next.candidates.front(), error)) {
      drop();
      return;
    }
    if (next.candidates.front() != path_) drop();
    next.consume = false;
    path_ = next.candidates.front();
    step_ = step;
    keeps_model_and_optimizer_ = next.keeps_model_and_optimizer;
    commits.after_next_commit([this] { drop(); });
  }

  /// Removes it (nothing when there is none).
  void drop() {
    if (path_.empty()) return;
    std::error_code ignored;  // gone already: nothing to report
    std::filesystem::remove(path_, ignored);
    path_.clear();
    step_ = -1;
    keeps_model_and_optimizer_ = false;
  }

 private:
  std::filesystem::path path_;
  std::int64_t step_ = -1;
  bool keeps_model_and_optimizer_ = false;
};

}  // namespace trainloop::distributed::elastic
