#pragma once
/// @file
/// @brief What elastic training (elastic_fit.hpp) needs of a rank's engine (gpu_mode/rank_engine.hpp):
/// its rank, its step commits, and what it does to the model and its copies when a rank is lost.

#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/elastic/admission.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/elastic/step_committer.hpp>
#include <trainloop/distributed/job/rank_env.hpp>

#include <chrono>
#include <cstdint>
#include <functional>

namespace trainloop::distributed::elastic {

/// What the elastic fit needs of the engine.
struct ElasticFitParts {
  const RankEnv* env = nullptr;                    ///< this rank (the launcher's numbering)
  StepCommitter* commits = nullptr;                ///< the engine's commits of this fit
  std::function<void()> put_back_committed_state;  ///< buffers as committed, gradients cleared
  /// The model's buffers as they are now held as the committed ones until the next commit (a hand-off
  /// in place: StepCommitter::hold_buffers_through_next_fit).
  std::function<void()> hold_committed_buffers;
  std::chrono::milliseconds elastic_wait{30000};   ///< gpu_mode's elastic_wait
  std::function<std::uintmax_t()> state_bytes;     ///< about what a checkpoint of the loop takes (where it fits)
  /// Sharded state (ZeRO): this rank's copies of its own and its neighbour's shares
  /// (share_copies.hpp); null when the state is replicated.
  std::function<ShareCopies*()> share_copies;
  /// Replacements (admission.hpp): rank 0's queue (null elsewhere), and in a replacement the
  /// options of the group it joins (backend, device, timeout).
  JoinWatch* join_watch = nullptr;
  ProcessGroupOptions group_options;  ///< a replacement's group: backend, device, timeout

  /// state_bytes() where the engine can tell, else 0 (a hand-off's folder is then chosen by name alone).
  std::uintmax_t state_bytes_or_zero() const { return state_bytes ? state_bytes() : 0; }
};

}  // namespace trainloop::distributed::elastic
