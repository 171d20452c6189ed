#pragma once
/// @file
/// @brief Dividing a node's cores between the ranks (or replicas) that run on it.
///
/// N processes on one box that each start a full OpenMP/BLAS pool run N× more threads than
/// cores; oversubscription measured 2× slower here. So each of N ranks gets
/// cores / N intra-op threads, unless the user chose OMP_NUM_THREADS, which always wins.
///
/// The Launcher puts the divided count into each child's OMP_NUM_THREADS (so OpenMP and
/// OpenBLAS pools start at the right size); a rank then calls
/// `apply_intra_op_threads(intra_op_threads_for(env.local_world_size))`, which reads it back.

#include <trainloop/distributed/rank_env.hpp>
#include <trainloop/detail/blas_threads.hpp>
#include <trainloop/error.hpp>

#include <ATen/Parallel.h>

#include <algorithm>
#include <optional>
#include <sched.h>
#include <string>
#include <thread>

namespace trainloop::dist {

/// Cores this process may run on: its CPU affinity mask (what taskset, cgroups cpusets and
/// Slurm's binding leave us), falling back to std::thread::hardware_concurrency().
inline int usable_cpu_count() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof mask, &mask) == 0) {
    int count = CPU_COUNT(&mask);
    if (count > 0) return count;
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

/// The thread count the user set with OMP_NUM_THREADS, or nullopt when unset. For OpenMP's
/// nested form "4,2" the outer level (4) is returned.
/// @throws trainloop::Error when the value is not a positive integer.
inline std::optional<int> omp_num_threads_from_env() {
  auto text = detail::env_string("OMP_NUM_THREADS");
  if (!text) return std::nullopt;
  std::string first = text->substr(0, text->find(','));
  return static_cast<int>(detail::parse_integer(first, "OMP_NUM_THREADS", 1, 1 << 16));
}

/// Intra-op threads for one of `ranks_on_node` processes sharing this node:
/// OMP_NUM_THREADS when set, otherwise max(1, usable cores / ranks_on_node).
inline int intra_op_threads_for(int ranks_on_node) {
  TRAINLOOP_CHECK(ranks_on_node >= 1, "ranks_on_node is ", ranks_on_node, "; expected >= 1");
  if (auto user_choice = omp_num_threads_from_env()) return *user_choice;
  return std::max(1, usable_cpu_count() / ranks_on_node);
}

/// Value the launcher puts in OMP_NUM_THREADS of each of `ranks_on_node` children, or nullopt
/// when the user set OMP_NUM_THREADS: children then inherit it unchanged (nested lists too).
inline std::optional<std::string> omp_num_threads_for_children(int ranks_on_node) {
  if (omp_num_threads_from_env()) return std::nullopt;
  return std::to_string(intra_op_threads_for(ranks_on_node));
}

/// Sets libtorch's intra-op pool size (torch::set_num_threads) for this process.
/// Call it early, before the first parallel op: with libtorch's native thread pool the size
/// cannot change once the pool has started.
inline void apply_intra_op_threads(int threads) {
  TRAINLOOP_CHECK(threads >= 1, "intra-op thread count is ", threads, "; expected >= 1");
  at::set_num_threads(threads);  // torch::set_num_threads is this function
  // Debian's libtorch multiplies matrices with the pthread OpenBLAS, whose own pool ignores
  // at::set_num_threads: without this, every rank would also start one BLAS thread per core.
  ::trainloop::detail::OpenBlasThreads::loaded().set(threads);
}

}  // namespace trainloop::dist
