#pragma once
/// @file
/// @brief The thread rule under the names DDP code has used (`trainloop::dist::`); the rule itself,
/// for every mode, is in threads/cpu_threads.hpp.
///
/// N processes on one box that each start a full OpenMP/BLAS pool run N× more threads than
/// cores; oversubscription measured 2× slower here. So each of N ranks gets cores / N intra-op
/// threads, unless the user chose OMP_NUM_THREADS, which always wins. The Launcher puts the
/// divided count into each child's OMP_NUM_THREADS (so OpenMP pools start at the right size);
/// a rank then calls `apply_intra_op_threads(intra_op_threads_for(env.local_world_size))`.

#include <trainloop/cpu/threads.hpp>

namespace trainloop::dist {

using cpu::apply_intra_op_threads;
using cpu::blas_threads_for_children;
using cpu::intra_op_threads_for;
using cpu::omp_num_threads_for_children;
using cpu::omp_num_threads_from_env;
using cpu::usable_cpu_count;

}  // namespace trainloop::dist
