#pragma once
/// @file
/// @brief The loop's checkpoint policy, independent of any mode: a save every rank agrees
/// succeeded or failed, and a resume that falls back to older checkpoints when asked to.

#include <trainloop/checkpoint/resume.hpp>
#include <trainloop/error.hpp>

#include <cstddef>
#include <exception>
#include <filesystem>
#include <functional>
#include <iostream>
#include <string>
#include <system_error>

namespace trainloop::detail {

/// Runs `write` where `writes` is true, then tells every rank whether it worked (`any_rank` is
/// the mode's agreement collective), so none trains on believing its work is saved.
/// @throws the writer's own exception (a CheckpointError naming the path and the reason) on the
///         rank that failed; a CheckpointError saying another rank failed on the others.
inline void write_checkpoint_agreed(const std::filesystem::path& path, bool writes,
                                    const std::function<bool(bool)>& any_rank, const std::function<void()>& write) {
  std::exception_ptr failure;
  if (writes) {
    try {
      write();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  if (any_rank(failure != nullptr)) {
    if (failure) std::rethrow_exception(failure);  // as itself: its type and text name the cause
    throw CheckpointError(concat("trainloop: another rank could not write the checkpoint ", path.string(),
                                 " (its error names the cause); training stops so no work is lost unsaved"));
  }
}

/// Loads the first readable checkpoint of `resume` with `load`; false when there was none to
/// load. An unreadable candidate is skipped with a warning when the spec allows falling back.
/// `any_rank` (the mode's agreement collective; none: this process alone) makes every rank move on
/// together: a candidate one rank cannot read (its part of a per-rank checkpoint) is skipped by all,
/// so no two ranks resume from different checkpoints.
/// @throws trainloop::CheckpointError when none is readable (or the one asked for is not).
inline bool resume_first_readable(const ResumeSpec& resume, bool is_main,
                                  const std::function<void(const std::filesystem::path&)>& load,
                                  const std::function<bool(bool)>& any_rank = {}) {
  if (resume.candidates.empty()) {
    if (resume.required && !resume.description.empty()) {
      throw CheckpointError(concat("trainloop: no checkpoint to resume from at ", resume.description));
    }
    say_fresh_start(resume, is_main);
    return false;
  }
  for (size_t i = 0; i < resume.candidates.size(); ++i) {
    std::exception_ptr failure;
    std::string reason;
    try {
      load(resume.candidates[i]);
    } catch (const CheckpointError& error) {
      failure = std::current_exception();
      reason = error.what();
    }
    if (!(any_rank ? any_rank(failure != nullptr) : failure != nullptr)) {
      if (is_main && resume.announce) std::cerr << "trainloop: resumed from " << resume.candidates[i].string() << '\n';
      if (resume.consume) {
        std::error_code ignored;  // nothing to report if it is gone
        if (std::filesystem::is_directory(resume.candidates[i], ignored)) {
          // A per-rank checkpoint every rank read: every rank passed the agreement above, so its holder
          // removes it (rank 0; on several machines each machine's copy has its own: elastic/machine_directory.hpp).
          if (resume.removes_directory.value_or(is_main)) std::filesystem::remove_all(resume.candidates[i], ignored);
        } else {
          std::filesystem::remove(resume.candidates[i], ignored);  // a file of this process only
        }
      }
      return true;
    }
    if (reason.empty()) {
      reason = concat("trainloop: another rank could not read the checkpoint ", resume.candidates[i].string(),
                      " (its error names the cause)");
    }
    const bool last_candidate = i + 1 == resume.candidates.size();
    if (!resume.fall_back || last_candidate) {
      if (failure) std::rethrow_exception(failure);
      throw CheckpointError(reason);
    }
    if (is_main) {
      std::cerr << reason << "\ntrainloop: falling back to the previous checkpoint, " << resume.candidates[i + 1].string()
                << '\n';
    }
  }
  return false;
}

}  // namespace trainloop::detail
