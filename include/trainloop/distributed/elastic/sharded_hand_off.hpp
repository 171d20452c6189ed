#pragma once
/// @file
/// @brief Elastic training of sharded state after a loss (share_copies.hpp has the copies): the
/// step every survivor holds, written from the survivors' copies as a per-rank checkpoint in
/// memory, in DCP's layout — each survivor its own `__<rank>_0.distcp`, the keeper of a lost rank
/// that rank's file from its neighbour's copy, rank 0 the loop's state and `.metadata` — from
/// which every survivor resumes with the new world size (elastic_fit.hpp). On several machines
/// each machine gets a whole copy (machine_directory.hpp).

#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/elastic/box_descriptor.hpp>
#include <trainloop/distributed/elastic/machine_directory.hpp>
#include <trainloop/distributed/elastic/membership.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <string>
#include <system_error>
#include <unistd.h>
#include <vector>

namespace trainloop::distributed::elastic {

namespace detail {

/// Appends `value` as 8 bytes.
inline void put_number(std::string& out, int64_t value) { out.append(reinterpret_cast<const char*>(&value), 8); }

}  // namespace detail

/// After a loss: the step `m.oldest_step` that every survivor holds, written from the survivors'
/// copies as a per-rank checkpoint of the `old_world` ranks that lost `m.lost`, in memory; returns
/// this machine's copy of its directory (machine_directory.hpp: one a machine, complete on each;
/// its `lead` removes it once read). A collective over `group`, the survivors' new group. `bytes`
/// estimates the whole state's size (where it fits).
/// @throws trainloop::CommunicationError on every survivor when a lost rank's keeper was lost too
///         (no copy remains), and when any survivor could not write its part.
inline MachineDirectory write_sharded_hand_off(ProcessGroup& group, const ShareCopies& copies, const Membership& m,
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
  // Each machine's lead makes its copy of the directory; every survivor writes its files into its machine's.
  std::exception_ptr failure;
  MachineDirectory directory =
      machine_directory(group, env, {}, ::trainloop::detail::concat(::getpid(), "-g", generation, "-step", step, ".dcp"),
                        bytes, failure);
  const std::filesystem::path partial = directory.path;
  std::string parts;  // (old rank, length, metadata part) for each file this rank writes
  const ShareCopies::Slot* slot = copies.slot_of(step);
  if (!failure) {
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
          add_part(lost.rank, ShareCopies::neighbour_boxes(*slot));
          copies.remove_neighbour_files();  // its shares are in the hand-off now; nobody else knows the files
        }
      }
    } catch (...) {
      failure = std::current_exception();
    }
  }
  torch::Tensor row = torch::empty({static_cast<int64_t>(parts.size())}, torch::kUInt8);
  if (!parts.empty()) std::memcpy(row.data_ptr(), parts.data(), parts.size());
  const std::vector<torch::Tensor> rows = group.gather_rows_to(row, 0);
  if (group.rank() == 0 && !failure) {  // rank 0 leads the first machine: the loop's state and `.metadata` go there
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
      ::trainloop::detail::write_checkpoint_metadata(partial, by_rank, partial.string());
    } catch (...) {
      failure = std::current_exception();
    }
  }
  // Several machines: each copy gets the files written on the others.
  const std::filesystem::path target = complete_every_copy(
      group, directory, failure,
      ::trainloop::detail::concat("trainloop: the survivors could not hand the sharded state of step ", step,
                                  " on from their copies"));
  directory.path = target;
  directory.made = false;
  return directory;
}

}  // namespace trainloop::distributed::elastic
