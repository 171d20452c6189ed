#pragma once
/// @file
/// @brief How many threads each process (and each DataParallel replica) computes with, decided
/// by trainloop in every mode from the cores this process may use.
///
/// The rule (measured: benchmarks/README.md, "Thread configuration"):
/// - usable cores = the CPU affinity mask (taskset, cpusets, Slurm's binding), capped by a cgroup
///   CPU quota (containers: cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us);
/// - a process that shares the node with P training processes (DDP ranks on this node; 1
///   otherwise) gets max(1, cores / P) intra-op threads (libtorch's pool, at::set_num_threads),
///   and a DataParallel replica max(1, cores / replicas);
/// - OpenBLAS's own pool, which at::set_num_threads does not reach, gets 1 thread: libtorch
///   already splits convolutions and element-wise work over its intra-op threads, and an OpenBLAS
///   pool on top of that oversubscribed the cores and made every product allocate and free its
///   buffers (2.9 M page faults per epoch of the example, 52 s instead of 13 s);
/// - what the user chose wins: OMP_NUM_THREADS (the intra-op count; OpenBLAS then keeps its own
///   setting, e.g. OPENBLAS_NUM_THREADS), or TrainLoopOptions::num_threads.

#include <trainloop/detail/blas_threads.hpp>
#include <trainloop/detail/environment.hpp>
#include <trainloop/error.hpp>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sched.h>
#include <string>
#include <thread>

namespace trainloop::cpu {

/// CPUs a cgroup CPU quota allows this process (rounded up), or nullopt without a quota.
/// `root` is where cgroups are mounted (a parameter for tests).
inline std::optional<int> cgroup_cpu_quota(const std::filesystem::path& root = "/sys/fs/cgroup") {
  // cgroup v2: "max 100000" (no quota) or "200000 100000" (2 CPUs).
  if (std::ifstream v2(root / "cpu.max"); v2) {
    std::string quota;
    long long period = 0;
    if (v2 >> quota >> period && quota != "max" && period > 0) {
      return std::max(1, static_cast<int>(std::ceil(std::stod(quota) / static_cast<double>(period))));
    }
    return std::nullopt;
  }
  // cgroup v1: quota -1 means none.
  std::ifstream quota_file(root / "cpu" / "cpu.cfs_quota_us"), period_file(root / "cpu" / "cpu.cfs_period_us");
  long long quota = -1, period = 0;
  if (quota_file >> quota && period_file >> period && quota > 0 && period > 0) {
    return std::max(1, static_cast<int>(std::ceil(static_cast<double>(quota) / static_cast<double>(period))));
  }
  return std::nullopt;
}

/// Cores this process may run on: its CPU affinity mask (what taskset, cgroups cpusets and
/// Slurm's binding leave us; std::thread::hardware_concurrency() when unknown), capped by a
/// cgroup CPU quota.
inline int usable_cpu_count() {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof mask, &mask) == 0 && CPU_COUNT(&mask) > 0) cores = CPU_COUNT(&mask);
  if (auto quota = cgroup_cpu_quota()) cores = std::min(cores, *quota);
  return cores;
}

/// The thread count the user set with OMP_NUM_THREADS, or nullopt when unset. For OpenMP's
/// nested form "4,2" the outer level (4) is returned.
/// @throws trainloop::ConfigurationError when the value is not a positive integer.
inline std::optional<int> omp_num_threads_from_env() {
  auto text = ::trainloop::detail::env_string("OMP_NUM_THREADS");
  if (!text) return std::nullopt;
  std::string first = text->substr(0, text->find(','));
  return static_cast<int>(::trainloop::detail::parse_integer(first, "OMP_NUM_THREADS", 1, 1 << 16));
}

/// The intra-op thread count asked for in code (TrainLoopOptions::num_threads); 0 when none.
inline std::atomic<int>& requested_threads() {
  static std::atomic<int> requested{0};
  return requested;
}

/// The user's own intra-op thread count, if any: OMP_NUM_THREADS, else TrainLoopOptions::num_threads.
inline std::optional<int> user_threads() {
  if (auto from_environment = omp_num_threads_from_env()) return from_environment;
  if (const int requested = requested_threads().load(); requested > 0) return requested;
  return std::nullopt;
}

/// Intra-op threads for one of `sharing` processes (or replicas) on this node: the user's
/// choice when there is one, otherwise max(1, usable cores / sharing).
inline int intra_op_threads_for(int sharing) {
  TRAINLOOP_CHECK(sharing >= 1, "ranks_on_node is ", sharing, "; expected >= 1");
  if (auto chosen = user_threads()) return *chosen;
  return std::max(1, usable_cpu_count() / sharing);
}

/// Value the launcher puts in OMP_NUM_THREADS of each of `ranks_on_node` children, or nullopt
/// when the user set OMP_NUM_THREADS: children then inherit it unchanged (nested lists too).
inline std::optional<std::string> omp_num_threads_for_children(int ranks_on_node) {
  if (omp_num_threads_from_env()) return std::nullopt;
  return std::to_string(intra_op_threads_for(ranks_on_node));
}

/// Value the launcher puts in OPENBLAS_NUM_THREADS of its children: "1" (the rule above), or
/// nullopt when the user chose threads (OMP_NUM_THREADS or OPENBLAS_NUM_THREADS set): then the
/// children inherit the user's environment unchanged.
inline std::optional<std::string> blas_threads_for_children() {
  if (omp_num_threads_from_env() || ::trainloop::detail::env_string("OPENBLAS_NUM_THREADS")) return std::nullopt;
  return "1";
}

/// OpenBLAS's thread count under the rule above: 1, unless the user chose the thread counts
/// through the environment (then OpenBLAS keeps what OPENBLAS_NUM_THREADS or its default made it).
inline std::optional<int> blas_threads_for(int /*intra_op_threads*/) {
  if (omp_num_threads_from_env()) return std::nullopt;
  return 1;
}

/// Sets libtorch's intra-op pool size (at::set_num_threads) for this process, and OpenBLAS's
/// (blas_threads_for). Call it early, before the first parallel op: with libtorch's native
/// thread pool the size cannot change once the pool has started.
inline void apply_intra_op_threads(int threads) {
  TRAINLOOP_CHECK(threads >= 1, "intra-op thread count is ", threads, "; expected >= 1");
  at::set_num_threads(threads);
  if (auto blas = blas_threads_for(threads)) ::trainloop::detail::OpenBlasThreads::loaded().set(*blas);
}

/// Configures this process for training alone on its cores (single mode): once per process, and
/// again only when the count would change.
inline void configure_single_process() {
  static int applied = 0;
  const int threads = intra_op_threads_for(1);
  if (threads == applied) return;
  apply_intra_op_threads(threads);
  applied = threads;
}

}  // namespace trainloop::cpu
