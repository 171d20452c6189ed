#pragma once
/// @file
/// @brief Whether the job's group formed (elastic training under trainloop's launcher). Elastic
/// training goes on from a formed group: a rank lost before it formed — its program failed before
/// fit(), or in the engine's set-up — leaves the others waiting for it in the group's rendezvous
/// until the timeout. So each rank marks the run directory once it is in the group, and the
/// launcher ends the job at once, named as without elastic training, for a rank lost while no mark
/// is there (distributed/launch/launcher.hpp).

#include <trainloop/distributed/job/rank_env.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>

namespace trainloop::distributed {

/// The mark in trainloop's run directory `run_dir` (an empty file; the run directory goes with the launch).
inline std::filesystem::path group_formed_mark(const std::filesystem::path& run_dir) { return run_dir / "group-formed"; }

/// In a rank trainloop's launcher started, once it is in the job's group: creates the mark (nothing
/// elsewhere: torchrun, srun and mpirun have no run directory).
inline void mark_group_formed(const RankEnv& env) {
  if (env.source != RankEnvSource::Trainloop || env.run_dir.empty()) return;
  const int fd = ::open(group_formed_mark(env.run_dir).c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd >= 0) ::close(fd);
}

}  // namespace trainloop::distributed
