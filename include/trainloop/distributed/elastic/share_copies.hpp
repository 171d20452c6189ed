#pragma once
/// @file
/// @brief Elastic training of sharded state (ZeRO-1/2/3): the shares of a lost rank survive it.
/// At the start of every optimizer step after the first commit (the state the last step left,
/// what a checkpoint of it holds), each rank copies its own shares of a per-rank checkpoint —
/// its pieces of the parameters and of their optimizer state, and on rank 0 what no rank shards
/// (the model's buffers) — into one host block, and sends the block to the rank before it: rank r
/// keeps rank r+1's copy (the last keeps rank 0's). Rank 0 also keeps the loop's state of that
/// step (trainloop.pt: the progress, the callbacks, every rank's streams and sums from the step's
/// commit) in a file in memory.
///
/// Two slots, for steps S and S-1: a copy being refreshed when a rank is lost never leaves a
/// survivor without a whole step. Every step's gradient reduction waits for every rank, so the
/// newest step the survivors completed differs by at most one between them, and each holds the
/// oldest of those (elastic_fit.hpp resumes from it).
///
/// After a loss, write_sharded_hand_off() (sharded_hand_off.hpp) writes that step as a per-rank checkpoint in memory —
/// each survivor its own file, the keeper of a lost rank that rank's file from its copy, rank 0
/// the loop's state and `.metadata` — and the survivors resume from it with the new world size,
/// as a run that changed its world size at that step on purpose resumes from its checkpoint
/// (loop/checkpoint_io.hpp reads it, resharded N to M). Two neighbours lost at once leave a share
/// without a copy: the job ends named.
///
/// What it costs, each step, on every rank: a copy of its shares (host memory: twice its share,
/// own and its neighbour's, in each of two slots) and one pass of that many bytes to a neighbour
/// (Gloo's send and receive); measured in benchmarks/README.md ("elastic_recovery").

#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/point_to_point.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/elastic/box_descriptor.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <system_error>
#include <unistd.h>
#include <utility>
#include <vector>

namespace trainloop::distributed::elastic {

namespace detail {

/// Where a file (or directory) of elastic training of about `bytes` goes: /dev/shm when it has
/// room for it (a container's is often 64 MiB), else the run directory or TMPDIR. `name` starts
/// with "trainloop-elastic-<launcher pid>-" (the launcher removes what a killed rank leaves).
inline std::filesystem::path in_memory_path(const RankEnv& env, const std::string& name, std::uintmax_t bytes) {
  std::error_code error;
  const std::filesystem::path shm("/dev/shm");
  const std::filesystem::space_info space = std::filesystem::space(shm, error);
  const bool in_memory = !error && std::filesystem::is_directory(shm, error) && space.available > bytes + (64u << 20);
  const std::filesystem::path folder = in_memory             ? shm
                                       : !env.run_dir.empty() ? std::filesystem::path(env.run_dir)
                                                              : std::filesystem::temp_directory_path();
  return folder / ::trainloop::detail::concat("trainloop-elastic-", env.launcher_pid, "-", name);
}

}  // namespace detail

/// @brief This rank's copies of its own and its neighbour's shares, for the last two steps (see the file comment).
class ShareCopies {
 public:
  /// One step's copies.
  struct Slot {
    int64_t step = -1;                         ///< the global step it holds; -1 while refreshed or empty
    ::trainloop::detail::ShareCapture own;     ///< this rank's shares, in one block
    torch::Tensor neighbour_boxes;             ///< the descriptor of the neighbour's block
    torch::Tensor neighbour_block;             ///< the neighbour's shares (rank r+1's)
    std::filesystem::path loop_state;          ///< rank 0: the loop's state of that step (trainloop.pt)
  };

  ShareCopies() = default;
  ShareCopies(const ShareCopies&) = delete;
  ShareCopies& operator=(const ShareCopies&) = delete;
  ~ShareCopies() { reset(); }

  /// Drops every copy (a fit's start, or its clean end) and removes the loop-state files.
  void reset() noexcept {
    for (Slot& slot : slots_) {
      std::error_code ignored;
      if (!slot.loop_state.empty()) std::filesystem::remove(slot.loop_state, ignored);
      slot = Slot();
    }
  }

  /// The newest step whose copies are whole on this rank, -1 when none.
  int64_t newest_step() const { return std::max(slots_[0].step, slots_[1].step); }
  /// The slot holding `step`, or null.
  const Slot* slot_of(int64_t step) const {
    for (const Slot& slot : slots_) {
      if (step >= 0 && slot.step == step) return &slot;
    }
    return nullptr;
  }
  /// The step `step`'s copies, a collective over `group` (every rank at the same step): copies
  /// this rank's `shares` (and, on rank 0, `whole` and `volatile_whole`: what no rank shards) into
  /// its slot, `write_loop_state(file)` on rank 0, then the block to the rank before it and the
  /// block of the rank after it into the slot (rank 0's loop-state file lives in /dev/shm, named
  /// after its pid and the slot, removed by reset()).
  void keep(ProcessGroup& group, const RankEnv& env, int64_t step, const std::vector<::trainloop::TensorShare>& shares,
            const std::vector<std::pair<std::string, torch::Tensor>>& whole,
            const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole,
            const std::function<void(const std::filesystem::path&)>& write_loop_state) {
    Slot& slot = slots_[static_cast<size_t>(step % 2)];
    if (slot.step == step) return;
    slot.step = -1;  // not whole until the neighbour's block is in
    slot.own.plan(shares, whole, volatile_whole, /*one_block=*/true);
    const std::atomic<bool> never{false};
    slot.own.copy(never);
    if (write_loop_state) {
      if (slot.loop_state.empty()) {
        slot.loop_state = detail::in_memory_path(env, ::trainloop::detail::concat(::getpid(), "-slot", step % 2, ".pt"), 0);
      }
      write_loop_state(slot.loop_state);
    }
    slot.neighbour_boxes = pass_to_left(group, detail::encode_boxes(slot.own.boxes()), slot.neighbour_boxes);
    progress::test_kill_point(progress::KillPoint::ShareCopy);  // its neighbours inside the block's pass
    slot.neighbour_block = pass_to_left(group, slot.own.block(), slot.neighbour_block);
    slot.step = step;
  }

 private:
  std::array<Slot, 2> slots_;
};

}  // namespace trainloop::distributed::elastic
