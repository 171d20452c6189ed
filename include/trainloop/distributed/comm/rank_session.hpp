#pragma once
/// @file
/// @brief This process's place in a distributed job, shared by the DDP engine and by user code:
/// is_main_process(), rank0_first(), barrier() — and the one process group they use.
///
/// The group is created lazily, once per process, from the environment (our launcher, torchrun,
/// Slurm or Open MPI), so `rank0_first` works before any TrainLoop exists, and the DDP engine
/// reuses the same group instead of opening a second store on the same port.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/job/main_process.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/job/replacement.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <mutex>
#include <optional>
#include <string>
#include <utility>

namespace trainloop {
namespace distributed {
namespace detail {

struct SessionGroup {
  std::mutex mutex;
  ProcessGroup group;
  ProcessGroupOptions options;
};

inline SessionGroup& session_group() {
  static SessionGroup session;
  return session;
}

}  // namespace detail

/// @brief The process group of this rank, created on first use with `options` (rank, world size,
/// master address and port are taken from the environment and override those in `options`).
/// @throws trainloop::Error outside a distributed job, or when a later call asks for a different
///         backend than the group was created with.
inline ProcessGroup& session_process_group(ProcessGroupOptions options = {}) {
  const auto& env = detail::cached_rank_env();
  TRAINLOOP_CHECK(env.has_value(), "no distributed job: none of the launcher, torchrun, Slurm or Open MPI "
                                   "variables (e.g. RANK and WORLD_SIZE) is set");
  auto& session = detail::session_group();
  std::lock_guard<std::mutex> lock(session.mutex);
  // A replacement's group is made when the survivors admit it (distributed/elastic/admission.hpp).
  TRAINLOOP_CHECK(session.group.valid() || !awaiting_admission(),
                  "this process replaces a lost rank and has not joined the job yet; expected its process group "
                  "to be asked for once fit() admitted it (barrier() and rank0_first() do not wait until then)");
  options.rank = env->rank;
  options.world_size = env->world_size;
  options.master_addr = env->master_addr;
  options.master_port = env->master_port;
  if (env->use_agent_store) options.is_store_server = false;
  // As torch's env:// handler does ("/worker/attempt_N"): keys of a failed attempt stay in the
  // agent's store, and a restarted rank must never read them.
  if (env->restart_count > 0)
    options.store_prefix = "attempt_" + std::to_string(env->restart_count) + "/" + options.store_prefix;
  if (!session.group.valid()) {
    session.group = ProcessGroup::create(options);
    session.group.log_collectives();  // the stall watchdog compares the ranks' calls of this group
    session.options = options;
  } else {
    TRAINLOOP_CHECK(options.backend == Backend::Auto || options.backend == session.group.backend(),
                    "the process group already exists with backend ", to_string(session.group.backend()),
                    "; a second one with backend ", to_string(options.backend), " was asked for");
  }
  return session.group;
}

}  // namespace distributed

/// @brief Waits for every rank of the job; does nothing outside a distributed job.
inline void barrier() {
  // A replacement not yet admitted joins at a step boundary of the running fit: nobody waits for it here.
  if (distributed::awaiting_admission()) return;
  if (distributed::detail::cached_rank_env()) distributed::session_process_group().barrier();
}

/// @brief Runs `f` on rank 0 first, then on the other ranks (after rank 0 finished), like
/// fastai's rank0_first — for downloads, unpacking and caches that must not be built twice at
/// once. Outside a distributed job, just runs `f`.
/// @return what `f` returns.
template <class F>
decltype(auto) rank0_first(F&& f) {
  const auto& env = distributed::detail::cached_rank_env();
  if (!env || distributed::awaiting_admission()) return std::forward<F>(f)();  // a replacement: rank 0 did it long ago
  if (env->rank == 0) {
    // Rank 0 works alone while the others wait in the barrier: not a stall.
    progress::PhaseScope phase(progress::Phase::RankZeroFirst);
    struct BarrierAfter {
      ~BarrierAfter() noexcept(false) {
        if (std::uncaught_exceptions() == 0) barrier();
      }
    } after;
    return std::forward<F>(f)();
  }
  barrier();
  return std::forward<F>(f)();
}

}  // namespace trainloop
