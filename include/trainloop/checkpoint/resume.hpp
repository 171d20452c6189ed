#pragma once
/// @file
/// @brief What `fit(..., resume)` resumes from: "last" (the ModelCheckpoint's newest, falling back
/// to older ones when it is unreadable), a checkpoint directory, or one file.

#include <trainloop/checkpoint/checkpoint_names.hpp>
#include <trainloop/checkpoint/checkpoint_source.hpp>
#include <trainloop/error.hpp>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>
#include <vector>

namespace trainloop::detail {

/// The checkpoints to try, in order, and whether failing to find one is an error.
struct ResumeSpec {
  std::vector<std::filesystem::path> candidates;  ///< newest first; the first readable one is used
  bool required = true;                           ///< no candidate at all is an error
  bool fall_back = false;                         ///< an unreadable candidate is skipped (with a warning)
  std::string description;                        ///< what was asked for, for messages
  bool announce = true;                           ///< say on stderr which checkpoint was resumed
};

/// How often the job was restarted after a failure: trainloop's launcher (max_restarts) or
/// torchrun (--max-restarts) say so in the environment; 0 on a first run.
inline int restart_count() {
  for (const char* name : {"TRAINLOOP_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"}) {
    if (const char* value = std::getenv(name); value != nullptr && *value != '\0') return std::atoi(value);
  }
  return 0;
}

/// Turns fit()'s `resume` argument into candidates: "" nothing (unless the job was restarted:
/// then "last" if a ModelCheckpoint is given, and nothing when it has no checkpoint yet);
/// "last" the ModelCheckpoint's checkpoints, newest first (none yet: start fresh); a directory
/// its checkpoints, newest first; anything else that one file.
/// `checkpoints` is the CheckpointSource among fit()'s callbacks (a ModelCheckpoint), or null.
/// @throws trainloop::ConfigurationError for "last" without a CheckpointSource.
inline ResumeSpec resolve_resume(const std::string& resume, const CheckpointSource* checkpoints) {
  ResumeSpec spec;
  spec.description = resume;
  std::string wanted = resume;
  if (wanted.empty() && restart_count() > 0 && checkpoints != nullptr) wanted = "last";
  if (wanted.empty()) return spec;
  if (wanted == "last") {
    TRAINLOOP_CHECK(checkpoints != nullptr, "fit() was asked to resume from \"last\" but no ModelCheckpoint is among "
                                            "its callbacks; expected one (its directory holds \"last\"), or a path");
    spec.candidates = checkpoints->candidates();
    spec.required = false;  // a first run has none yet
    spec.fall_back = true;
    spec.description = (checkpoints->last_path()).string();
    return spec;
  }
  if (std::filesystem::is_directory(wanted)) {
    spec.candidates = checkpoint_candidates(wanted);
    spec.fall_back = true;
    TRAINLOOP_CHECK(!spec.candidates.empty(), "fit() was asked to resume from directory ", wanted,
                    ", which holds no checkpoint (*.ckpt); expected one written by ModelCheckpoint");
    return spec;
  }
  spec.candidates = {wanted};
  return spec;
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
ResumeSpec resolve_resume(const std::string& resume, const Components& components) {
  const CheckpointSource* checkpoints = nullptr;
  for (const auto& component : components) {
    if (auto* found = dynamic_cast<const CheckpointSource*>(component.get())) checkpoints = found;
  }
  return resolve_resume(resume, checkpoints);
}

}  // namespace trainloop::detail
