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

/// The current exception as a trainloop::Error: a CheckpointError naming `path` with the cause
/// nested, for what is not one already (an allocation, libtorch, the file system), so every
/// rank's failure is one ModelCheckpoint handles (stop_on_error off: every rank goes on).
inline std::exception_ptr checkpoint_failure(const std::filesystem::path& path) {
  try {
    throw;
  } catch (const Error&) {
    return std::current_exception();
  } catch (const std::exception& error) {
    try {
      std::throw_with_nested(CheckpointError(concat("trainloop: cannot write the checkpoint ", path.string(), ": ",
                                                    error.what(), "; the previous checkpoints are unchanged")));
    } catch (...) {
      return std::current_exception();
    }
  }
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

/// Writes a per-rank checkpoint of `module` and `optimizer` at `path` (see the file comment). A
/// collective. `write_loop_state(file)` writes trainloop.pt on rank 0.
/// @throws trainloop::CheckpointError on every rank when any rank could not write.
template <ModeEngine Engine, class Module>
void save_sharded_checkpoint(Engine& engine, Module& module, torch::optim::Optimizer& optimizer,
                             const std::filesystem::path& target,
                             const std::function<void(const std::filesystem::path&)>& write_loop_state) {
  const bool main = engine.rank() == 0;
  std::exception_ptr failure;
  const std::filesystem::path path = target.has_filename() ? target : target.parent_path();  // "runs/x.ckpt/"
  // 1. The temporary directory, named by rank 0.
  std::string temporary;
  if (main) {
    try {
      temporary = make_temporary_directory_for(path).string();
    } catch (...) {
      failure = checkpoint_failure(path);
    }
  }
  struct RemoveUnlessCommitted {  // on rank 0, whatever fails after this
    std::filesystem::path directory;
    bool armed;
    ~RemoveUnlessCommitted() {
      std::error_code ignored;
      if (armed && !directory.empty()) std::filesystem::remove_all(directory, ignored);
    }
  } cleanup{temporary, main};
  temporary = row_text(gather_rows(engine, text_row(temporary)).front());
  agree_or_throw(engine, failure, path);
  // 2. Every rank's file: its shares; on rank 0 also what no rank shards, whole.
  std::string part;
  try {
    const std::vector<TensorShare> shares = checkpoint_shares(engine, module, optimizer);
    std::vector<std::pair<std::string, torch::Tensor>> whole;
    if (main) {
      // The optimizer's parameters are the layout every rank's shares cut; the rest is whole here.
      std::unordered_set<const void*> seen;  // and a tied parameter once, under its first name
      for (const auto& group : optimizer.param_groups()) {
        for (const auto& parameter : group.params()) seen.insert(parameter.unsafeGetTensorImpl());
      }
      for (const auto& item : module.named_parameters()) {
        if (seen.insert(item.value().unsafeGetTensorImpl()).second) {
          whole.emplace_back("model." + item.key(), item.value());
        }
      }
      for (const auto& item : module.named_buffers()) whole.emplace_back("model." + item.key(), item.value());
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
    write_loop_state(std::filesystem::path(temporary) / kDcpLoopStateFile);
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
