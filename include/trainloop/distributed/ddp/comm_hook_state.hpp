#pragma once
/// @file
/// @brief The comm hooks' state in a DDP checkpoint (PowerSGD's Q and error feedback): every
/// rank's GradientCommHook::save_state, gathered on the writing rank into the optimizer archive's
/// "trainloop_comm_hook" entry — "world_size" and "rank<r>", each rank's state serialized as
/// bytes — and handed back to each rank by a DDP run with the same world size. libtorch's own
/// loader ignores the entry, so the file stays loadable anywhere. (A sharded optimizer's part of
/// the archive is distributed/zero/sharded_state.hpp's.)

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/serialization/archive/torch_archive.hpp>

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
/// checked as the checkpoint itself was (serialization/archive/torch_archive.hpp), through a temporary
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

/// @brief Writes every rank's `hook` state into `archive` on each rank where `writes` (a
/// collective while there is a group and a hook; nothing otherwise).
inline void save_comm_hook_state(ProcessGroup* group, const GradientCommHook* hook, torch::serialize::OutputArchive& archive,
                                 bool writes) {
  if (group == nullptr || hook == nullptr) return;
  const torch::Tensor bytes = detail::comm_hook_state_bytes(*hook);
  const torch::Tensor writers = group->all_gather(torch::full({1}, writes ? 1 : 0, torch::kInt64)).reshape({-1});
  for (int root = 0; root < group->world_size(); ++root) {
    if (writers[root].item<std::int64_t>() == 0) continue;
    const std::vector<torch::Tensor> rows = group->gather_rows_to(bytes, root);
    if (root != group->rank()) continue;
    torch::serialize::OutputArchive hooks;
    hooks.write("world_size", torch::full({1}, group->world_size(), torch::kInt64));
    for (std::size_t r = 0; r < rows.size(); ++r) hooks.write("rank" + std::to_string(r), rows[r]);
    archive.write("trainloop_comm_hook", hooks);
  }
}

/// @brief Gives `hook` this rank's saved state back when the checkpoint was written by as many
/// ranks; with another world size, or none saved, it starts afresh (as the first fit did).
/// @throws trainloop::CheckpointError when the saved state is not an archive of plain values.
inline void load_comm_hook_state(ProcessGroup* group, GradientCommHook* hook, torch::serialize::InputArchive& archive,
                                 const torch::Device& device) {
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
