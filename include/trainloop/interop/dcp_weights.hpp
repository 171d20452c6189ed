#pragma once
/// @file
/// @brief A model's weights to and from a directory in torch.distributed.checkpoint's layout
/// (DCP: `.metadata` + `__<rank>_0.distcp`), the format of PyTorch's sharded checkpoints.
///
/// ```
/// // Python:  dcp.save({"model": model.state_dict()}, checkpoint_id="weights")
/// trainloop::interop::load_dcp_weights(*net, "weights");   // then train it in any mode
/// trainloop::interop::save_dcp_weights(*net, "exported");  // Python: dcp.load({"model": sd}, checkpoint_id="exported")
/// trainloop::interop::dcp_to_safetensors("runs/last.ckpt", "model.safetensors");  // tensor by tensor
/// ```
///
/// A trainloop checkpoint of a sharded mode (checkpoint/dcp_checkpoint.hpp) is such a directory
/// too: load_dcp_weights reads its weights. Reading goes tensor by tensor (the memory it takes
/// beyond the model's: the largest tensor); the metadata is read with the safe pickle reader (no
/// code runs) and every item is checked against its file before anything is copied.

#include <trainloop/checkpoint/dcp_checkpoint.hpp>
#include <trainloop/detail/atomic_directory.hpp>
#include <trainloop/interop/safetensors_weights.hpp>
#include <trainloop/serialization/dcp/metadata_file.hpp>

#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::interop {

/// @brief Loads every parameter and buffer of `module` from the DCP checkpoint `directory`,
/// stored under `prefix` + its name (`model.fc.weight` for `dcp.save({"model": sd})`); all or
/// nothing: every name, shape and dtype is checked before anything is copied.
/// @throws trainloop::CheckpointError naming the directory and the first tensor that is missing
///         or differs, or the file that is missing or corrupt.
inline void load_dcp_weights(torch::nn::Module& module, const std::filesystem::path& directory,
                             const std::string& prefix = "model.") {
  ::trainloop::detail::DcpCheckpoint checkpoint(directory);
  checkpoint.check_model(module, prefix);
  checkpoint.load_model(module, prefix);
}

/// @brief Writes every parameter and buffer of `module` as a one-rank DCP checkpoint in
/// `directory` (`prefix` + name), which appears whole or not at all (detail/atomic_directory.hpp).
/// @throws trainloop::CheckpointError naming the directory when it cannot be written.
inline void save_dcp_weights(const torch::nn::Module& module, const std::filesystem::path& directory,
                             const std::string& prefix = "model.") {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::unordered_set<const void*> seen;  // a tied parameter once, under its first name
  for (const auto& item : module.named_parameters()) {
    if (seen.insert(item.value().unsafeGetTensorImpl()).second) tensors.emplace_back(prefix + item.key(), item.value());
  }
  for (const auto& item : module.named_buffers()) tensors.emplace_back(prefix + item.key(), item.value());
  const std::filesystem::path temporary = ::trainloop::detail::make_temporary_directory_for(directory);
  try {
    serialization::dcp::Metadata metadata = ::trainloop::detail::write_rank_file(temporary, 0, {}, tensors);
    for (const auto& [key, entry] : metadata.tensors) metadata.planner_data[key] = ::trainloop::detail::planner_path_of(key);
    serialization::dcp::write_metadata(temporary, metadata);
    ::trainloop::detail::commit_directory(temporary, directory);
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove_all(temporary, ignored);
    throw;
  }
}

/// @brief The weights of a DCP checkpoint `directory` (`prefix` + name: a sharded mode's
/// per-rank checkpoint, or Python's dcp.save) as safetensors at `path` (one file, or Hugging Face's
/// sharded form: interop/safetensors_weights.hpp), streamed tensor by tensor: the process holds one
/// tensor at a time, never the model. So a model bigger than one rank gets its safetensors
/// without any rank holding it whole: every rank writes its share (TrainLoop::save_checkpoint under
/// sharding), then one process converts.
/// @throws trainloop::CheckpointError naming the directory or file that cannot be read or written.
inline void dcp_to_safetensors(const std::filesystem::path& directory, const std::filesystem::path& path,
                               const SafetensorsSaveOptions& options = {}, const std::string& prefix = "model.") {
  ::trainloop::detail::DcpCheckpoint checkpoint(directory);
  std::vector<serialization::SafetensorsSpec> specs;
  std::vector<std::string> keys;
  for (const auto& [key, entry] : checkpoint.metadata().tensors) {
    if (key.rfind(prefix, 0) != 0) continue;
    specs.push_back({key.substr(prefix.size()), entry.dtype, entry.size});
    keys.push_back(key);
  }
  if (specs.empty()) {
    throw CheckpointError(::trainloop::detail::concat("trainloop: checkpoint ", directory.string(), " holds no tensor under '",
                                         prefix, "'; expected a model's weights (dcp.save({\"model\": ...}))"));
  }
  save_safetensors(specs, [&](size_t i) { return checkpoint.read_whole(keys[i]); }, path, options);
}

}  // namespace trainloop::interop
