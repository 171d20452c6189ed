#pragma once
/// @file
/// @brief What a DDP checkpoint's optimizer part holds beyond one rank's optimizer: under ZeRO
/// every rank's share of the state (gathered into libtorch's layout, so any mode resumes from
/// it), and with a comm hook every rank's hook state (PowerSGD's Q and error feedback).
///
/// The optimizer archive is libtorch's (Optimizer::save) with one more entry,
/// "trainloop_comm_hook": "world_size" and "rank<r>", each rank's GradientCommHook::save_state
/// serialized as bytes. libtorch's own loader ignores the entry, so the file stays loadable
/// anywhere; a DDP run with the same world size hands each rank its own part back.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/serialization/torch_archive.hpp>

#include <torch/torch.h>

#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

namespace trainloop::distributed {

namespace detail {

/// The comm hook's state is an archive stored as bytes inside the checkpoint, whoever wrote the
/// file, and libtorch's reader compiles an archive's code (a crafted one crashed its parser):
/// checked as the checkpoint itself was (serialization/torch_archive.hpp), through a temporary
/// file, before libtorch reads it.
/// @throws trainloop::CheckpointError when the bytes are not an archive of plain values.
inline void check_hook_state_runs_no_code(const torch::Tensor& bytes) {
  std::string path = (std::filesystem::temp_directory_path() / "trainloop-hook-state-XXXXXX").string();
  const int fd = ::mkstemp(path.data());
  if (fd < 0) {
    throw CheckpointError(::trainloop::detail::concat("trainloop: cannot create ", path, " to check the comm hook's state in ",
                                                      "the checkpoint (", std::strerror(errno), "); expected a writable ",
                                                      std::filesystem::temp_directory_path().string()));
  }
  struct Removed {
    std::string path;
    ~Removed() { ::unlink(path.c_str()); }
  } removed{path};
  const auto* data = reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>());
  size_t left = static_cast<size_t>(bytes.numel());
  while (left > 0) {
    const ssize_t written = ::write(fd, data, left);
    if (written <= 0) {
      if (written < 0 && errno == EINTR) continue;
      ::close(fd);
      throw CheckpointError(::trainloop::detail::concat("trainloop: cannot write ", path, " to check the comm hook's state (",
                                                        std::strerror(errno), "); expected free space there"));
    }
    data += written;
    left -= static_cast<size_t>(written);
  }
  ::close(fd);
  serialization::TorchArchive(path, "expected the comm hook state trainloop writes",
                              "the comm hook state of the checkpoint being resumed, copied to ")
      .check_runs_no_code();
}

/// `hook`'s state on this rank (GradientCommHook::save_state), serialized, as bytes.
inline torch::Tensor comm_hook_state_bytes(const GradientCommHook& hook) {
  torch::serialize::OutputArchive state;
  hook.save_state(state);
  std::ostringstream stream;
  state.save_to(stream);
  const std::string bytes = stream.str();
  return torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<std::int64_t>(bytes.size())}, torch::kUInt8)
      .clone();
}
}  // namespace detail

/// Writes `optimizer`'s whole state into `archive` on each rank where `writes`. Without a group
/// (the launching process), ZeRO and a hook, only the writer serializes; otherwise a collective:
/// each writing rank (rank 0; with spawned ranks on several machines, each machine's local rank 0)
/// in turn gathers every rank's ZeRO share and hook state, writes them and lets the share go.
inline void save_ddp_optimizer_state(ProcessGroup* group, ZeroOptimizerShard* zero, const GradientCommHook* hook,
                                     torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive,
                                     bool writes) {
  if (group == nullptr || (zero == nullptr && hook == nullptr)) {
    if (writes) ::trainloop::detail::save_optimizer_state(optimizer, archive);
    return;
  }
  const torch::Tensor hook_bytes = hook ? detail::comm_hook_state_bytes(*hook) : torch::Tensor();
  const torch::Tensor writers = group->all_gather(torch::full({1}, writes ? 1 : 0, torch::kInt64)).reshape({-1});
  for (int root = 0; root < group->world_size(); ++root) {
    if (writers[root].item<std::int64_t>() == 0) continue;
    struct Release {  // the root lets the gathered share go, also when writing throws
      ZeroOptimizerShard* shard;
      torch::optim::Optimizer& optimizer;
      ~Release() {
        if (shard) shard->release_gathered(optimizer);
      }
    } release{zero, optimizer};
    if (zero) zero->gather_state(optimizer, *group, root);
    std::vector<torch::Tensor> hook_rows;
    if (hook) hook_rows = group->gather_rows_to(hook_bytes, root);
    if (root != group->rank()) continue;
    ::trainloop::detail::save_optimizer_state(optimizer, archive);
    if (hook) {
      torch::serialize::OutputArchive hooks;
      hooks.write("world_size", torch::full({1}, group->world_size(), torch::kInt64));
      for (std::size_t r = 0; r < hook_rows.size(); ++r) hooks.write("rank" + std::to_string(r), hook_rows[r]);
      archive.write("trainloop_comm_hook", hooks);
    }
  }
}

/// Loads a whole optimizer state (any mode's checkpoint); under ZeRO this rank keeps its share
/// (the whole state is read first: the checkpoint reader loads every tensor of the file).
/// `hook` gets this rank's saved state back when the checkpoint was written by as many ranks;
/// with another world size, or none saved, it starts afresh (as the first fit did).
inline void load_ddp_optimizer_state(ProcessGroup* group, ZeroOptimizerShard* zero, GradientCommHook* hook,
                                     torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive,
                                     const torch::Device& device) {
  ::trainloop::detail::load_optimizer_state(optimizer, archive);
  if (zero) zero->keep_own_share(optimizer);
  torch::serialize::InputArchive hooks;
  torch::Tensor saved_world, bytes;
  if (hook == nullptr || group == nullptr || !archive.try_read("trainloop_comm_hook", hooks) ||
      !hooks.try_read("world_size", saved_world) || saved_world.item<std::int64_t>() != group->world_size() ||
      !hooks.try_read("rank" + std::to_string(group->rank()), bytes)) {
    return;
  }
  bytes = bytes.to(torch::kCPU).contiguous();  // the checkpoint reader put it on the model's device
  detail::check_hook_state_runs_no_code(bytes);
  torch::serialize::InputArchive state;
  state.load_from(reinterpret_cast<const char*>(bytes.data_ptr<std::uint8_t>()), static_cast<std::size_t>(bytes.numel()),
                  device);
  hook->load_state(state);
}

}  // namespace trainloop::distributed
