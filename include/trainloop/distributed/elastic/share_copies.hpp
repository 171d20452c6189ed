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
/// After a loss, write_sharded_hand_off() writes that step as a per-rank checkpoint in memory —
/// each survivor its own file, the keeper of a lost rank that rank's file from its copy, rank 0
/// the loop's state and `.metadata` — and the survivors resume from it with the new world size,
/// as a run that changed its world size at that step on purpose resumes from its checkpoint
/// (loop/checkpoint_io.hpp reads it, resharded N to M). Two neighbours lost at once leave a share
/// without a copy: the job ends named.
///
/// What it costs, each step, on every rank: a copy of its shares (host memory: twice its share,
/// own and its neighbour's, in each of two slots) and one pass of that many bytes to a neighbour
/// (Gloo's send and receive); measured in benchmarks/README.md ("elastic_recovery").

#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/checkpoint/share_capture.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/elastic/membership.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <limits>
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

constexpr int64_t kBoxesMagic = 0x736f7870;  // "pxos": a descriptor of copied boxes

/// The boxes of a block as bytes (their keys, dtypes, places in the whole tensors and in the
/// block), which the neighbour keeping the block needs to write it as a checkpoint file.
inline torch::Tensor encode_boxes(const std::vector<::trainloop::detail::CapturedBox>& boxes) {
  std::vector<int64_t> numbers{kBoxesMagic, static_cast<int64_t>(boxes.size())};
  std::string keys;
  for (const auto& box : boxes) {
    const torch::Tensor& buffer = box.buffer;
    numbers.push_back(static_cast<int64_t>(buffer.scalar_type()));
    numbers.push_back(static_cast<int64_t>(box.size.size()));
    numbers.insert(numbers.end(), box.offsets.begin(), box.offsets.end());
    numbers.insert(numbers.end(), box.size.begin(), box.size.end());
    for (int64_t extent : buffer.sizes()) numbers.push_back(extent);
    numbers.push_back(buffer.storage_offset() * static_cast<int64_t>(buffer.element_size()));
    numbers.push_back(static_cast<int64_t>(box.key.size()));
    keys += box.key;
  }
  torch::Tensor bytes = torch::empty({static_cast<int64_t>(numbers.size() * 8 + keys.size())}, torch::kUInt8);
  std::memcpy(bytes.data_ptr(), numbers.data(), numbers.size() * 8);
  if (!keys.empty()) std::memcpy(static_cast<char*>(bytes.data_ptr()) + numbers.size() * 8, keys.data(), keys.size());
  return bytes;
}

/// The boxes `encoded` describes, their buffers views into `block`. Every number is checked
/// against the message and the block (a rank's own job sent it, but nothing is read out of bounds).
/// @throws trainloop::CommunicationError naming what does not fit.
inline std::vector<::trainloop::detail::CapturedBox> decode_boxes(const torch::Tensor& encoded, const torch::Tensor& block) {
  const int64_t total = encoded.numel();
  const auto* bytes = static_cast<const char*>(encoded.data_ptr());
  int64_t at = 0;
  auto bad = [&](const std::string& what) {
    return CommunicationError(::trainloop::detail::concat("trainloop: a neighbour's copy of sharded state is malformed (",
                                                          what, "); expected the layout this release sends"));
  };
  auto number = [&]() {
    if (at + 8 > total) throw bad("the descriptor ends early");
    int64_t value = 0;
    std::memcpy(&value, bytes + at, 8);
    at += 8;
    return value;
  };
  if (number() != kBoxesMagic) throw bad("no descriptor mark");
  const int64_t count = number();
  if (count < 0 || count > total / 8) throw bad(::trainloop::detail::concat(count, " boxes"));
  struct Raw {
    c10::ScalarType dtype;
    std::vector<int64_t> offsets, size, sizes;
    int64_t byte_offset = 0, key_length = 0;
  };
  std::vector<Raw> raws;
  for (int64_t i = 0; i < count; ++i) {
    Raw raw;
    const int64_t dtype = number();
    if (dtype < 0 || dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) throw bad(::trainloop::detail::concat("dtype ", dtype));
    raw.dtype = static_cast<c10::ScalarType>(dtype);
    const int64_t dims = number();
    if (dims < 0 || dims > 16) throw bad(::trainloop::detail::concat(dims, " dimensions"));
    for (int64_t d = 0; d < dims; ++d) raw.offsets.push_back(number());
    for (int64_t d = 0; d < dims; ++d) raw.size.push_back(number());
    for (int64_t d = 0; d < dims; ++d) raw.sizes.push_back(number());
    raw.byte_offset = number();
    raw.key_length = number();
    raws.push_back(std::move(raw));
  }
  std::vector<::trainloop::detail::CapturedBox> boxes;
  for (Raw& raw : raws) {
    if (raw.key_length < 0 || raw.key_length > total - at) throw bad("a key runs past the descriptor");
    std::string key(bytes + at, static_cast<size_t>(raw.key_length));
    at += raw.key_length;
    int64_t elements = 1;
    for (size_t d = 0; d < raw.sizes.size(); ++d) {
      if (raw.sizes[d] < 0 || raw.offsets[d] < 0 || raw.size[d] < 0 || raw.offsets[d] > raw.size[d] - raw.sizes[d]) {
        throw bad("a box outside its tensor");
      }
      if (raw.sizes[d] > 0 && elements > std::numeric_limits<int64_t>::max() / 16 / raw.sizes[d]) throw bad("a box too large");
      elements *= raw.sizes[d];
    }
    const int64_t item = static_cast<int64_t>(c10::elementSize(raw.dtype));
    const int64_t length = elements * item;
    if (raw.byte_offset < 0 || raw.byte_offset % item != 0 || raw.byte_offset > block.numel() - length) {
      throw bad("a box outside the block");
    }
    torch::Tensor buffer = block.narrow(0, raw.byte_offset, length).view(raw.dtype).view(raw.sizes);
    boxes.push_back({std::move(key), std::move(raw.offsets), std::move(raw.size), torch::Tensor(), std::move(buffer), true});
  }
  if (at != total) throw bad("bytes after the last key");
  return boxes;
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
  /// Host memory the copies hold (both slots, own and the neighbour's).
  int64_t bytes() const {
    int64_t total = 0;
    for (const Slot& slot : slots_) {
      total += slot.own.block().defined() ? slot.own.block().numel() : 0;
      total += slot.neighbour_block.defined() ? slot.neighbour_block.numel() : 0;
    }
    return total;
  }

  /// The step `step`'s copies, a collective over `group` (every rank at the same step): copies
  /// this rank's `shares` (and, on rank 0, `whole` and `volatile_whole`: what no rank shards) into
  /// its slot, `write_loop_state(file)` on rank 0, then the block to the rank before it and the
  /// block of the rank after it into the slot. `loop_state_name` names rank 0's file.
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
    slot.neighbour_boxes = group.pass_to_left(detail::encode_boxes(slot.own.boxes()), slot.neighbour_boxes);
    progress::test_kill_point(progress::KillPoint::ShareCopy);  // its neighbours inside the block's pass
    slot.neighbour_block = group.pass_to_left(slot.own.block(), slot.neighbour_block);
    slot.step = step;
  }

 private:
  std::array<Slot, 2> slots_;
};

namespace detail {

/// `text` from `root` to every rank of `group` (its length first).
inline std::string broadcast_text(ProcessGroup& group, const std::string& text, int root) {
  torch::Tensor length = torch::full({1}, static_cast<int64_t>(text.size()), torch::kInt64);
  group.broadcast(length, root);
  torch::Tensor bytes = torch::empty({length.item<int64_t>()}, torch::kUInt8);
  if (group.rank() == root && !text.empty()) std::memcpy(bytes.data_ptr(), text.data(), text.size());
  if (bytes.numel() > 0) group.broadcast(bytes, root);
  return std::string(static_cast<const char*>(bytes.data_ptr()), static_cast<size_t>(bytes.numel()));
}

/// Appends `value` as 8 bytes.
inline void put_number(std::string& out, int64_t value) { out.append(reinterpret_cast<const char*>(&value), 8); }

}  // namespace detail

/// After a loss: the step `m.oldest_step` that every survivor holds, written from the survivors'
/// copies as a per-rank checkpoint of the `old_world` ranks that lost `m.lost`, in memory; returns
/// its directory (the same on every survivor). A collective over `group`, the survivors' new
/// group. `bytes` estimates the whole state's size (where it fits).
/// @throws trainloop::CommunicationError on every survivor when a lost rank's keeper was lost too
///         (no copy remains), and when any survivor could not write its part.
inline std::filesystem::path write_sharded_hand_off(ProcessGroup& group, const ShareCopies& copies, const Membership& m,
                                                    int old_rank, int old_world, const RankEnv& env, int generation,
                                                    std::uintmax_t bytes) {
  const int64_t step = m.oldest_step;
  auto is_member = [&](int rank) { return std::find(m.members.begin(), m.members.end(), rank) != m.members.end(); };
  for (const LostRank& lost : m.lost) {
    const int keeper = (lost.rank + old_world - 1) % old_world;
    if (!is_member(keeper)) {
      throw CommunicationError(::trainloop::detail::concat(
          "trainloop: rank ", lost.rank, " was lost, and rank ", keeper, ", which kept the only copy of its shards of "
          "the sharded state, was lost with it; the job cannot go on without them (elastic training of sharded state "
          "survives ranks lost one at a time, or any two that are not neighbours); restart it from its last checkpoint"));
    }
  }
  // Rank 0 names and makes the directory; every survivor writes its files into it.
  std::exception_ptr failure;
  std::string name;
  if (group.rank() == 0) {
    try {
      const std::filesystem::path target =
          detail::in_memory_path(env, ::trainloop::detail::concat(::getpid(), "-g", generation, "-step", step, ".dcp"), bytes);
      std::error_code ignored;
      std::filesystem::remove_all(target, ignored);
      std::filesystem::remove_all(target.string() + ".partial", ignored);
      std::filesystem::create_directories(target.string() + ".partial");
      name = target.string();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  name = detail::broadcast_text(group, name, 0);
  const std::filesystem::path target(name);
  const std::filesystem::path partial(name + ".partial");
  std::string parts;  // (old rank, length, metadata part) for each file this rank writes
  const ShareCopies::Slot* slot = copies.slot_of(step);
  if (!name.empty()) {
    try {
      TRAINLOOP_CHECK(slot != nullptr, "rank ", old_rank, " holds no copy of step ", step, " (newest ", copies.newest_step(),
                      "); expected the step every survivor holds");
      auto add_part = [&](int rank, const std::vector<::trainloop::detail::CapturedBox>& boxes) {
        const std::string part = ::trainloop::detail::write_captured_rank_file(partial, rank, boxes);
        detail::put_number(parts, rank);
        detail::put_number(parts, static_cast<int64_t>(part.size()));
        parts += part;
      };
      add_part(old_rank, slot->own.boxes());
      for (const LostRank& lost : m.lost) {
        if ((lost.rank + old_world - 1) % old_world == old_rank) {
          add_part(lost.rank, detail::decode_boxes(slot->neighbour_boxes, slot->neighbour_block));
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  torch::Tensor row = torch::empty({static_cast<int64_t>(parts.size())}, torch::kUInt8);
  if (!parts.empty()) std::memcpy(row.data_ptr(), parts.data(), parts.size());
  const std::vector<torch::Tensor> rows = group.gather_rows_to(row, 0);
  if (group.rank() == 0 && !failure) {
    try {
      std::vector<std::string> by_rank(static_cast<size_t>(old_world));
      for (const torch::Tensor& gathered : rows) {
        const auto* data = static_cast<const char*>(gathered.data_ptr());
        for (int64_t at = 0; at + 16 <= gathered.numel();) {
          int64_t rank = 0, length = 0;
          std::memcpy(&rank, data + at, 8);
          std::memcpy(&length, data + at + 8, 8);
          TRAINLOOP_CHECK(rank >= 0 && rank < old_world && length >= 0 && length <= gathered.numel() - at - 16,
                          "a survivor's part of the hand-off is malformed (rank ", rank, ", ", length, " bytes)");
          by_rank[static_cast<size_t>(rank)].assign(data + at + 16, static_cast<size_t>(length));
          at += 16 + length;
        }
      }
      for (int r = 0; r < old_world; ++r) {
        TRAINLOOP_CHECK(!by_rank[static_cast<size_t>(r)].empty(), "no survivor wrote rank ", r, "'s shards of step ", step);
      }
      std::filesystem::copy_file(slot->loop_state, partial / ::trainloop::detail::kDcpLoopStateFile);
      ::trainloop::detail::write_checkpoint_metadata(partial, by_rank, target.string());
      std::filesystem::rename(partial, target);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  torch::Tensor failed = torch::full({1}, failure ? 1.0 : 0.0, torch::kFloat32);
  group.all_reduce_max(failed);
  if (failed.item<float>() > 0.5f) {
    if (group.rank() == 0) {
      std::error_code ignored;
      std::filesystem::remove_all(partial, ignored);
      std::filesystem::remove_all(target, ignored);
    }
    std::string cause = "another survivor could not write its part (its error names the cause)";
    if (failure) {
      try {
        std::rethrow_exception(failure);
      } catch (const std::exception& error) {
        cause = error.what();
      }
    }
    throw CommunicationError(::trainloop::detail::concat("trainloop: the survivors could not hand the sharded state of step ",
                                                         step, " on from their copies: ", cause));
  }
  return target;
}

}  // namespace trainloop::distributed::elastic
