#pragma once
/// @file
/// @brief Writing and reading a per-rank checkpoint (checkpoint/dcp_checkpoint.hpp has its layout)
/// through the mode's engine: every rank writes its own share in parallel, nothing is gathered,
/// and the checkpoint appears only once every rank's file and the metadata are durable.
///
/// The commit, every step agreed by every rank (a rank that fails says so, and every rank throws
/// before anything becomes visible):
/// 1. rank 0 makes a temporary directory next to the target and tells every rank its name;
/// 2. every rank writes and fsyncs its `__<rank>_0.distcp` there and sends rank 0 its part of
///    the metadata (small: names, boxes, byte ranges), bytes this loop carries without reading
///    (checkpoint/dcp_checkpoint.hpp owns the format: write_rank_part, write_checkpoint_metadata);
/// 3. rank 0 writes the loop's state (`trainloop.pt`) and `.metadata`, fsyncs them and the
///    directory, and renames it into place (detail/atomic_directory.hpp).
/// A kill at any moment leaves the previous checkpoint whole and at most a temporary directory,
/// which the next writer in that directory removes once its owner is dead.

#include <trainloop/checkpoint/background_write.hpp>
#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/checkpoint/loop_checkpoint.hpp>
#include <trainloop/detail/atomic_directory.hpp>
#include <trainloop/engine/sharded_members.hpp>
#include <trainloop/engine/gather_rows.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// `text` as a row of bytes, for gather_rows.
inline torch::Tensor text_row(const std::string& text) {
  return torch::from_blob(const_cast<char*>(text.data()), {static_cast<int64_t>(text.size())}, torch::kUInt8).clone();
}
/// A row of gather_rows as text.
inline std::string row_text(const torch::Tensor& row) {
  const torch::Tensor bytes = row.to(torch::kCPU).to(torch::kUInt8).contiguous();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()), static_cast<size_t>(bytes.numel()));
}

/// Throws on every rank when any rank failed (`failure` its own error, rethrown as itself there).
template <ModeEngine Engine>
void agree_or_throw(Engine& engine, const std::exception_ptr& failure, const std::filesystem::path& path) {
  if (!engine.any_rank(failure != nullptr)) return;
  if (failure) std::rethrow_exception(failure);
  throw CheckpointError(concat("trainloop: another rank could not write its share of the checkpoint ", path.string(),
                               " (its error names the cause); nothing was written, the previous checkpoints are "
                               "unchanged"));
}

/// The tensors of a per-rank checkpoint that no rank shards, which rank 0 writes whole.
struct UnshardedTensors {
  std::vector<std::pair<std::string, torch::Tensor>> parameters;  ///< those the optimizer does not step
  std::vector<std::pair<std::string, torch::Tensor>> buffers;     ///< the model's buffers
};

/// The optimizer's parameters are the layout every rank's shares cut; the rest is written whole by
/// rank 0 (a tied parameter once, under its first name).
template <class Module>
UnshardedTensors unsharded_tensors(Module& module, torch::optim::Optimizer& optimizer) {
  UnshardedTensors whole;
  std::unordered_set<const void*> seen;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& parameter : group.params()) seen.insert(parameter.unsafeGetTensorImpl());
  }
  for (const auto& item : module.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) whole.parameters.emplace_back("model." + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers()) whole.buffers.emplace_back("model." + item.key(), item.value());
  return whole;
}

/// Rank 0 removes the temporary directory of a checkpoint unless it was committed (or handed on).
struct RemoveUnlessCommitted {
  std::filesystem::path directory;  ///< the temporary directory
  bool armed;                       ///< whether it is removed at the end (rank 0, not committed)
  RemoveUnlessCommitted(std::filesystem::path made, bool remove) : directory(std::move(made)), armed(remove) {}
  RemoveUnlessCommitted(RemoveUnlessCommitted&& other) noexcept
      : directory(std::move(other.directory)), armed(std::exchange(other.armed, false)) {}
  RemoveUnlessCommitted& operator=(RemoveUnlessCommitted&&) = delete;
  ~RemoveUnlessCommitted() {
    std::error_code ignored;
    if (armed && !directory.empty()) std::filesystem::remove_all(directory, ignored);
  }
};

/// Step 1 of the commit: rank 0 makes the temporary directory next to `path` and every rank learns
/// its name (a collective). The guard removes it on rank 0 unless disarmed.
/// @throws trainloop::CheckpointError on every rank when rank 0 could not make it.
template <ModeEngine Engine>
RemoveUnlessCommitted agreed_temporary_directory(Engine& engine, const std::filesystem::path& path) {
  const bool main = engine.rank() == 0;
  std::exception_ptr failure;
  std::string temporary;
  if (main) {
    try {
      temporary = make_temporary_directory_for(path).string();
    } catch (...) {
      failure = checkpoint_failure(path);
    }
  }
  RemoveUnlessCommitted made(temporary, main);
  made.directory = row_text(gather_rows(engine, text_row(temporary)).front());
  agree_or_throw(engine, failure, path);
  return made;
}

/// The checkpoint's directory name: "runs/x.ckpt/" is "runs/x.ckpt".
inline std::filesystem::path checkpoint_directory_name(const std::filesystem::path& target) {
  return target.has_filename() ? target : target.parent_path();
}

/// Writes a per-rank checkpoint of `module` and `optimizer` at `path` (see the file comment). A
/// collective. `write_loop_state(file)` writes trainloop.pt on rank 0.
/// @throws trainloop::CheckpointError on every rank when any rank could not write.
template <ModeEngine Engine, class Module>
void save_sharded_checkpoint(Engine& engine, Module& module, torch::optim::Optimizer& optimizer,
                             const std::filesystem::path& target,
                             const std::function<void(const std::filesystem::path&)>& write_loop_state) {
  const bool main = engine.rank() == 0;
  const std::filesystem::path path = checkpoint_directory_name(target);
  // 1. The temporary directory, named by rank 0.
  RemoveUnlessCommitted cleanup = agreed_temporary_directory(engine, path);
  const std::filesystem::path temporary = cleanup.directory;
  // 2. Every rank's file: its shares; on rank 0 also what no rank shards, whole.
  std::exception_ptr failure;
  std::string part;
  try {
    const std::vector<TensorShare> shares = checkpoint_shares(engine, module, optimizer);
    std::vector<std::pair<std::string, torch::Tensor>> whole;
    if (main) {
      UnshardedTensors unsharded = unsharded_tensors(module, optimizer);
      whole = std::move(unsharded.parameters);
      whole.insert(whole.end(), unsharded.buffers.begin(), unsharded.buffers.end());
    }
    part = write_rank_part(temporary, static_cast<int>(engine.rank()), shares, whole);
  } catch (...) {
    failure = checkpoint_failure(path);
  }
  const std::vector<torch::Tensor> parts = gather_rows(engine, text_row(part));
  agree_or_throw(engine, failure, path);
  // 3. Rank 0: the loop's state, the metadata, the commit; every rank learns whether it worked.
  auto commit = [&] {
    std::vector<std::string> texts;
    for (const auto& row : parts) texts.push_back(row_text(row));
    write_loop_state(temporary / kDcpLoopStateFile);
    write_checkpoint_metadata(temporary, texts, path.string());
    commit_directory(temporary, path);
    cleanup.armed = false;
  };
  write_checkpoint_agreed(path, main, [&engine](bool flag) { return engine.any_rank(flag); }, [&] {
    try {
      commit();
    } catch (...) {
      std::rethrow_exception(checkpoint_failure(path));
    }
  });
}

}  // namespace trainloop::detail
