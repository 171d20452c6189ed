#pragma once
/// @file
/// @brief Elastic training of sharded state (ZeRO-1/2/3): the shares of a lost rank survive it.
/// At the start of every optimizer step after the first commit (the state the last step left,
/// what a checkpoint of it holds), each rank copies its own shares of a per-rank checkpoint —
/// its pieces of the parameters and of their optimizer state, and on rank 0 what no rank shards
/// (the model's buffers) — into one host block, which the rank before it keeps: rank r keeps rank
/// r+1's copy (the last keeps rank 0's). When that rank is on the same machine the block is a file
/// of /dev/shm (shared_copy_file.hpp), which outlives its writer: only its name goes to the keeper.
/// Otherwise (another machine, no room in /dev/shm, a device's shares, a launcher other than
/// trainloop's) the block itself is sent. Rank 0 also keeps the loop's state of that
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
/// What it costs, each step, on every rank: a copy of its shares (host memory: its share in each of
/// two slots), and with a keeper on another machine one pass of that many bytes to it (Gloo's send
/// and receive; then also the keeper's memory for them); measured in docs/elastic.md.

#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/point_to_point.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/distributed/comm/text_collectives.hpp>
#include <trainloop/distributed/elastic/box_descriptor.hpp>
#include <trainloop/distributed/elastic/shared_copy_file.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <optional>
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

/// What a rank tells its keeper of its copy: "F" and the file's name (SharedCopyFile), or "B" and
/// the descriptor of the block that follows over the wire.
inline torch::Tensor notice_of_file(const std::filesystem::path& file) {
  const std::string text = "F" + file.string();
  torch::Tensor bytes = torch::empty({static_cast<int64_t>(text.size())}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), text.data(), text.size());
  return bytes;
}
/// See notice_of_file().
inline torch::Tensor notice_of_block(const torch::Tensor& descriptor) {
  return torch::cat({torch::full({1}, static_cast<int64_t>('B'), torch::kUInt8), descriptor});
}
/// The file a notice names; empty when the block follows over the wire.
/// @throws trainloop::CommunicationError when the notice is neither.
inline std::filesystem::path file_in_notice(const torch::Tensor& notice) {
  const auto* bytes = static_cast<const char*>(notice.data_ptr());
  if (notice.numel() >= 1 && bytes[0] == 'B') return {};
  if (notice.numel() <= 1 || bytes[0] != 'F') {
    throw CommunicationError(::trainloop::detail::concat(
        "trainloop: a neighbour's notice of its copy of sharded state is ", notice.numel(), " bytes starting with ",
        notice.numel() > 0 ? static_cast<int>(bytes[0]) : -1, "; expected 'F' and a file or 'B' and a descriptor"));
  }
  const std::filesystem::path file(std::string(bytes + 1, static_cast<size_t>(notice.numel() - 1)));
  // Only a copy's own place: its keeper maps it after a loss, and removes it.
  if (file.parent_path() != "/dev/shm" || file.filename().string().rfind("trainloop-elastic-", 0) != 0) {
    throw CommunicationError(::trainloop::detail::concat("trainloop: a neighbour's copy of sharded state is in ", file.string(),
                                                         "; expected /dev/shm/trainloop-elastic-*"));
  }
  return file;
}

}  // namespace detail

/// @brief This rank's copies of its own and its neighbour's shares, for the last two steps (see the file comment).
class ShareCopies {
 public:
  /// One step's copies.
  struct Slot {
    int64_t step = -1;                         ///< the global step it holds; -1 while refreshed or empty
    ::trainloop::detail::ShareCapture own;     ///< this rank's shares, in one block
    SharedCopyFile own_file;                   ///< that block as a file of /dev/shm, when its keeper is on this machine
    torch::Tensor neighbour_boxes;             ///< the descriptor of the neighbour's block (when it was passed)
    torch::Tensor neighbour_block;             ///< the neighbour's shares (rank r+1's), when they were passed
    std::filesystem::path neighbour_file;      ///< else the neighbour's SharedCopyFile (read only after a loss)
    std::filesystem::path loop_state;          ///< rank 0: the loop's state of that step (trainloop.pt)
  };

  ShareCopies() = default;
  ShareCopies(const ShareCopies&) = delete;
  ShareCopies& operator=(const ShareCopies&) = delete;
  ~ShareCopies() { reset(); }

  /// Drops every copy (a fit's start, or its clean end), removes this rank's files and forgets
  /// which machine its neighbour is on (a new group may put another rank there).
  void reset() noexcept {
    for (Slot& slot : slots_) {
      std::error_code ignored;
      if (!slot.loop_state.empty()) std::filesystem::remove(slot.loop_state, ignored);
      slot = Slot();
    }
    left_is_local_.reset();
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
  /// The neighbour's boxes in `slot` (views of its block; from its file when it is in one).
  /// @throws trainloop::CommunicationError when that copy is not whole.
  static std::vector<::trainloop::detail::CapturedBox> neighbour_boxes(const Slot& slot) {
    if (slot.neighbour_file.empty()) return detail::decode_boxes(slot.neighbour_boxes, slot.neighbour_block);
    const auto [descriptor, block] = read_shared_copy(slot.neighbour_file, slot.step);
    return detail::decode_boxes(descriptor, block);
  }
  /// Removes the neighbour's files (it was lost, and its shares were handed on from them).
  void remove_neighbour_files() const noexcept {
    for (const Slot& slot : slots_) {
      std::error_code ignored;
      if (!slot.neighbour_file.empty()) std::filesystem::remove(slot.neighbour_file, ignored);
    }
  }
  /// The step `step`'s copies, a collective over `group` (every rank at the same step): copies
  /// this rank's `shares` (and, on rank 0, `whole` and `volatile_whole`: what no rank shards) into
  /// its slot, `write_loop_state(file)` on rank 0, then tells the rank before it where they are —
  /// a file of /dev/shm when that rank is on this machine (SharedCopyFile: nothing travels), else
  /// the block itself — and learns where the rank after it put its own (rank 0's loop-state file
  /// lives in /dev/shm, named after its pid and the slot, removed by reset()).
  void keep(ProcessGroup& group, const RankEnv& env, int64_t step, const std::vector<::trainloop::TensorShare>& shares,
            const std::vector<std::pair<std::string, torch::Tensor>>& whole,
            const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole,
            const std::function<void(const std::filesystem::path&)>& write_loop_state) {
    Slot& slot = slots_[static_cast<size_t>(step % 2)];
    if (slot.step == step) return;
    slot.step = -1;  // not whole until the neighbour's notice is in
    if (!left_is_local_) left_is_local_ = left_on_this_machine(group);
    // Files need trainloop's launcher: it removes what a killed rank leaves in /dev/shm.
    const bool may_use_file = *left_is_local_ && env.launcher_pid > 0;
    if (slot.own_file.holds(slot.own.block())) slot.own_file.unseal();
    std::function<torch::Tensor(int64_t)> file_block;
    if (may_use_file) {
      file_block = [&slot, &env, step](int64_t bytes) {
        const std::filesystem::path path =
            detail::in_memory_path(env, ::trainloop::detail::concat(::getpid(), "-copy-slot", step % 2), static_cast<std::uintmax_t>(bytes));
        return path.parent_path() == "/dev/shm" ? slot.own_file.block(path, bytes) : torch::Tensor();
      };
    }
    slot.own.plan(shares, whole, volatile_whole, /*one_block=*/true, file_block);
    const std::atomic<bool> never{false};
    slot.own.copy(never);
    if (write_loop_state) {
      if (slot.loop_state.empty()) {
        slot.loop_state = detail::in_memory_path(env, ::trainloop::detail::concat(::getpid(), "-slot", step % 2, ".pt"), 0);
      }
      write_loop_state(slot.loop_state);
    }
    progress::test_kill_point(progress::KillPoint::ShareCopy);  // nothing sealed or told yet: its keeper lacks this step
    const torch::Tensor descriptor = detail::encode_boxes(slot.own.boxes());
    const bool in_file = slot.own_file.holds(slot.own.block()) && slot.own_file.seal(descriptor, step);
    const torch::Tensor notice = in_file ? detail::notice_of_file(slot.own_file.path()) : detail::notice_of_block(descriptor);
    const torch::Tensor theirs = pass_to_left(group, notice);
    const std::filesystem::path their_file = detail::file_in_notice(theirs);
    slot.neighbour_file = their_file;
    slot.neighbour_boxes = their_file.empty() ? theirs.narrow(0, 1, theirs.numel() - 1) : torch::Tensor();
    // The blocks that travel: a rank whose copy is in a file sends none, and its keeper expects none.
    const torch::Tensor received = pass_to_left(group, in_file ? torch::empty({0}, torch::kUInt8) : slot.own.block(), slot.neighbour_block);
    slot.neighbour_block = their_file.empty() ? received : torch::Tensor();
    slot.step = step;
  }

 private:
  /// Whether the rank before this one runs on this machine (one all-gather of machine tags).
  static bool left_on_this_machine(ProcessGroup& group) {
    const std::vector<std::string> machines = all_texts(group, ::trainloop::detail::pid_domain_tag());
    const int world = group.world_size();
    return machines[static_cast<size_t>((group.rank() + world - 1) % world)] == machines[static_cast<size_t>(group.rank())];
  }

  std::array<Slot, 2> slots_;
  std::optional<bool> left_is_local_;  // known from the first copies of a fit
};

}  // namespace trainloop::distributed::elastic
