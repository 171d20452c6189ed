#pragma once
/// @file
/// @brief Elastic training's replicated hand-off (elastic_fit.hpp): the loop's state of the step the
/// survivors resume from, as a checkpoint file in this machine's memory, and that file sent from
/// one rank to every rank of a group.

#include <trainloop/detail/format.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <unistd.h>

namespace trainloop::distributed::elastic::detail {

/// The whole of `path` as bytes.
inline torch::Tensor file_bytes(const std::filesystem::path& path) {
  torch::Tensor data = torch::empty({static_cast<std::int64_t>(std::filesystem::file_size(path))}, torch::kUInt8);
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(data.data_ptr()), data.numel());
  TRAINLOOP_CHECK(in.gcount() == data.numel(), "cannot read ", path.string(), " (", data.numel(), " bytes)");
  return data;
}

/// Writes `data` as `path`, atomically (a ".partial" file renamed).
inline void write_file_bytes(const std::filesystem::path& path, const torch::Tensor& data) {
  const std::filesystem::path partial = path.string() + ".partial";
  {
    std::ofstream out(partial, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data.data_ptr()), data.numel());
    TRAINLOOP_CHECK(out.good(), "cannot write ", partial.string(), " (", data.numel(), " bytes)");
  }
  std::filesystem::rename(partial, path);
}

/// Room asked for a hand-off of the loop's state alone (no model, no optimizer state: every rank's
/// random stream, ~5 KB, its sums, the progress and the callbacks' states): far more than it takes.
inline constexpr std::uintmax_t kLoopStateBytes = std::uintmax_t{16} << 20;

/// Where this process's hand-off file of about `bytes` goes: /dev/shm when it has room for it (a
/// container's is often 64 MiB), else the run directory or TMPDIR (in_memory_path()). `kind` tells
/// two files of one generation apart.
inline std::filesystem::path hand_off_path(const RankEnv& env, int generation, std::uintmax_t bytes, const char* kind = "") {
  return in_memory_path(env, ::trainloop::detail::concat(::getpid(), "-g", generation, kind, ".ckpt"), bytes);
}

/// The file `write_root` writes on `root`, copied to every rank of `group` (a collective); returns
/// this rank's copy. `place(bytes)` says where a file of that size goes (`root_bytes`: the root's
/// estimate before it writes).
inline std::filesystem::path share_file(ProcessGroup& group, int root, std::uintmax_t root_bytes,
                                        const std::function<std::filesystem::path(std::uintmax_t)>& place,
                                        const std::function<void(const std::filesystem::path&)>& write_root) {
  torch::Tensor size = torch::zeros({1}, torch::kInt64);
  torch::Tensor data;
  std::filesystem::path path;
  if (group.rank() == root) {
    path = place(root_bytes);
    write_root(path);
    data = file_bytes(path);  // one read into the tensor that travels (a character iterator took seconds per GB)
    size.fill_(data.numel());
  }
  group.broadcast(size, root);
  if (group.rank() != root) data = torch::empty({size.item<std::int64_t>()}, torch::kUInt8);
  group.broadcast(data, root);
  if (group.rank() != root) {
    path = place(static_cast<std::uintmax_t>(data.numel()));
    write_file_bytes(path, data);
  }
  return path;
}

}  // namespace trainloop::distributed::elastic::detail
