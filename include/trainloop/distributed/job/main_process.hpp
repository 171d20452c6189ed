#pragma once
/// @file
/// @brief is_main_process(): the one process of a job that prints and writes the user's files.
/// Light on purpose (the environment only, no process group), so TrainLoop::is_main() can ask it
/// in every mode and the two always agree.

#include <trainloop/distributed/job/rank_env.hpp>

#include <optional>

namespace trainloop {
namespace distributed::detail {

/// The process-wide rank environment, read once.
inline const std::optional<RankEnv>& cached_rank_env() {
  static const std::optional<RankEnv> env = detect_rank_env();
  return env;
}

}  // namespace distributed::detail

/// @brief True in exactly one process of a job: the process the user started (when trainloop
/// spawns the ranks itself), or rank 0 (under torchrun, Slurm or Open MPI). Use it to guard
/// your own printing and file writing outside callbacks.
inline bool is_main_process() {
  const auto& env = distributed::detail::cached_rank_env();
  if (!env) return true;
  if (env->source == distributed::RankEnvSource::Trainloop) return false;  // the launching process prints
  return env->rank == 0;
}

}  // namespace trainloop
