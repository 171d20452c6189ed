#pragma once
/// @file
/// @brief What `fit(..., resume)` resumes from: "last" (the ModelCheckpoint's newest, falling back
/// to older ones when it is unreadable), a checkpoint directory, or one file; typed as
/// Resume::last() and Resume::from(path), or as fit()'s string argument.

#include <trainloop/checkpoint/checkpoint_names.hpp>
#include <trainloop/checkpoint/checkpoint_source.hpp>
#include <trainloop/error.hpp>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief What fit() resumes from, typed: `loop.fit(10, {checkpoints}, Resume::last())`. The
/// choices of fit()'s string argument ("", "last", a path), each behaving exactly as its string,
/// except that Resume::from("last") is the path `last`, never the keyword.
class Resume {
 public:
  /// @brief Nothing: continue from the loop as it stands (fit()'s ""). After a restart
  /// (max_restarts, torchrun) last() is implied when a ModelCheckpoint is among the callbacks.
  static Resume none() { return Resume(); }
  /// @brief The newest checkpoint of the ModelCheckpoint among fit()'s callbacks (fit()'s "last"):
  /// older ones are tried when it is unreadable, and training starts fresh when there is none yet,
  /// so one program both starts and, rerun after a crash, continues.
  static Resume last() { return Resume(Kind::last, {}); }
  /// @brief A checkpoint file, or a directory of checkpoints (its newest readable one is used).
  /// @throws trainloop::ConfigurationError for an empty path.
  static Resume from(std::filesystem::path checkpoint) {
    TRAINLOOP_CHECK(!checkpoint.empty(), "the path of Resume::from is empty; expected a checkpoint file or directory "
                                         "(Resume::none() resumes nothing)");
    return Resume(Kind::path, std::move(checkpoint));
  }
  /// @brief The same as none().
  Resume() = default;

  /// @brief True for none() (and a default Resume).
  bool is_none() const { return kind_ == Kind::none; }
  /// @brief True for last().
  bool is_last() const { return kind_ == Kind::last; }
  /// @brief The path of from(); empty for none() and last().
  const std::filesystem::path& path() const { return path_; }

 private:
  enum class Kind { none, last, path };
  Resume(Kind kind, std::filesystem::path checkpoint) : kind_(kind), path_(std::move(checkpoint)) {}
  Kind kind_ = Kind::none;
  std::filesystem::path path_;
};

}  // namespace trainloop

namespace trainloop::detail {

/// The checkpoints to try, in order, and whether failing to find one is an error.
struct ResumeSpec {
  std::vector<std::filesystem::path> candidates;  ///< newest first; the first readable one is used
  bool required = true;                           ///< no candidate at all is an error
  bool fall_back = false;                         ///< an unreadable candidate is skipped (with a warning)
  std::string description;                        ///< what was asked for, for messages
  bool announce = true;                           ///< say on stderr which checkpoint was resumed
  bool consume = false;                           ///< remove the file once loaded (elastic training's hand-off)
  /// A consumed directory (a per-rank checkpoint every rank reads) is removed by this rank when
  /// true, by none when false (another rank holds it), by the main rank when unset.
  std::optional<bool> removes_directory = std::nullopt;
  /// The file holds the loop's state without the model and the optimizer's state, which this
  /// process holds already as the file's step left them (elastic training's survivors that all
  /// committed that step): only the param groups' options, progress, callbacks and streams are read.
  bool keeps_model_and_optimizer = false;
};

/// A file the job wrote for this process to resume from (a launcher's initial state, elastic
/// training's hand-off): required, read as it is, not announced.
inline ResumeSpec handed_state(const std::filesystem::path& file) {
  ResumeSpec spec;
  spec.candidates = {file};
  spec.announce = false;
  return spec;
}

/// How often the job was restarted after a failure: trainloop's launcher (max_restarts) or
/// torchrun (--max-restarts) say so in the environment; 0 on a first run.
inline int restart_count() {
  for (const char* name : {"TRAINLOOP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return std::atoi(value);
  }
  return 0;
}

/// fit()'s string argument as a Resume: "" none, "last" last, anything else that path.
inline Resume resume_of(const std::string& resume) {
  if (resume.empty()) return Resume::none();
  if (resume == "last") return Resume::last();
  return Resume::from(resume);
}

/// Turns fit()'s `resume` argument into candidates: none() nothing (unless the job was restarted:
/// then last() if a ModelCheckpoint is given, and nothing when it has no checkpoint yet);
/// last() the ModelCheckpoint's checkpoints, newest first (none yet: start fresh); a directory
/// its checkpoints, newest first; any other path that one file.
/// `checkpoints` is the CheckpointSource among fit()'s callbacks (a ModelCheckpoint), or null.
/// @throws trainloop::ConfigurationError for last() without a CheckpointSource.
inline ResumeSpec resolve_resume(const Resume& resume, const CheckpointSource* checkpoints) {
  ResumeSpec spec;
  spec.description = resume.path().string();
  const bool last = resume.is_last() || (resume.is_none() && restart_count() > 0 && checkpoints != nullptr);
  if (resume.is_none() && !last) return spec;
  if (last) {
    TRAINLOOP_CHECK(checkpoints != nullptr, "fit() was asked to resume from \"last\" but no ModelCheckpoint is among "
                                            "its callbacks; expected one (its directory holds \"last\"), or a path");
    spec.candidates = checkpoints->candidates();
    spec.required = false;  // a first run has none yet
    spec.fall_back = true;
    spec.description = (checkpoints->last_path()).string();
    return spec;
  }
  const std::string wanted = resume.path().string();
  if (std::filesystem::is_directory(wanted) && !is_sharded_checkpoint(wanted)) {  // a directory of checkpoints
    spec.candidates = checkpoint_candidates(wanted);
    spec.fall_back = true;
    TRAINLOOP_CHECK(!spec.candidates.empty(), "fit() was asked to resume from directory ", wanted,
                    ", which holds no checkpoint (*.ckpt); expected one written by ModelCheckpoint");
    return spec;
  }
  spec.candidates = {wanted};
  return spec;
}

/// The same for fit()'s string argument ("", "last", or a path).
inline ResumeSpec resolve_resume(const std::string& resume, const CheckpointSource* checkpoints) {
  return resolve_resume(resume_of(resume), checkpoints);
}

/// Says on stderr (on the main process) that `resume` found no checkpoint yet and training starts
/// fresh; nothing when nothing was asked for.
inline void say_fresh_start(const ResumeSpec& resume, bool is_main) {
  if (!resume.description.empty() && is_main) {
    std::cerr << "trainloop: no checkpoint at " << resume.description << " yet; training from the start\n";
  }
}

/// The same, finding the CheckpointSource among `components` (the last one given wins).
template <class Components>
ResumeSpec resolve_resume(const Resume& resume, const Components& components) {
  const CheckpointSource* checkpoints = nullptr;
  for (const auto& component : components) {
    if (auto* found = dynamic_cast<const CheckpointSource*>(component.get())) checkpoints = found;
  }
  return resolve_resume(resume, checkpoints);
}

/// The same for fit()'s string argument.
template <class Components>
ResumeSpec resolve_resume(const std::string& resume, const Components& components) {
  return resolve_resume(resume_of(resume), components);
}

}  // namespace trainloop::detail
