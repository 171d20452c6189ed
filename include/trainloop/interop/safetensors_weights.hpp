#pragma once
/// @file
/// @brief A model's weights as safetensors (Hugging Face's format, read by
/// `safetensors.torch.load_file` and `from_pretrained`): save_safetensors() writes the model's
/// parameters and buffers by their state_dict names (one file, or the sharded form with an
/// index), load_safetensors() copies them back by name, strict by default.
///
/// The low-level pieces, for a sharded model that gathers one tensor at a time, are in
/// serialization/: SafetensorsFile and SafetensorsSource (read a tensor or a flat range of one),
/// write_safetensors() and write_safetensors_sharded() (specs first, then a producer callback).

#include <trainloop/error.hpp>
#include <trainloop/interop/load_state_dict.hpp>
#include <trainloop/interop/state_dict.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/safetensors/safetensors_index.hpp>
#include <trainloop/serialization/safetensors/safetensors_reader.hpp>
#include <trainloop/serialization/safetensors/safetensors_writer.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <unordered_set>
#include <vector>

namespace trainloop::interop {

/// @brief How save_safetensors() writes.
struct SafetensorsSaveOptions {
  /// 0: one .safetensors file at the path given (unless it is a directory or ends in
  /// ".index.json"); > 0: Hugging Face's sharded form with shards of at most this many bytes.
  uint64_t max_shard_bytes = 0;
  /// Every file's `__metadata__`: {"format": "pt"}, as transformers' `save_pretrained` writes (which
  /// `from_pretrained` checks; `safetensors.torch.save_file` writes none unless given one).
  std::map<std::string, std::string> metadata = serialization::safetensors_pt_metadata();
};

/// @brief Hugging Face's default shard size (`max_shard_size="5GB"`), used for the sharded form
/// when SafetensorsSaveOptions::max_shard_bytes is 0.
inline constexpr uint64_t kDefaultSafetensorsShardBytes = 5'000'000'000;

/// @brief Whether save_safetensors() writes the sharded form to `path`: an existing directory, a
/// path ending in '/' or ".index.json", or max_shard_bytes > 0.
inline bool writes_sharded_safetensors(const std::filesystem::path& path, const SafetensorsSaveOptions& options = {}) {
  std::error_code ignored;
  const std::string text = path.string();
  const std::string suffix = ".index.json";
  return options.max_shard_bytes > 0 || std::filesystem::is_directory(path, ignored) || (!text.empty() && text.back() == '/') ||
         (text.size() >= suffix.size() && text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0);
}

/// @brief Writes declared tensors as safetensors, asking `produce(i)` for tensor i only when it
/// is written (a sharded model gathers each in turn). The form follows the path: a file path
/// writes one .safetensors; a directory (or a path ending in '/') writes Hugging Face's sharded
/// form into it with `model.safetensors.index.json`; a path ending in ".index.json" writes that
/// index with the shards beside it. Every file is written atomically.
/// @param specs every tensor's name, dtype and shape, in order
/// @param produce returns tensor i (of specs[i]'s dtype and shape; any device and layout)
/// @param path where to write
/// @param options shard size and metadata
/// @throws trainloop::ConfigurationError for bad specs or a produced tensor that differs from its
///         spec; trainloop::CheckpointError naming the file that cannot be written.
inline void save_safetensors(const std::vector<serialization::SafetensorsSpec>& specs,
                             const serialization::SafetensorsProducer& produce, const std::filesystem::path& path,
                             const SafetensorsSaveOptions& options = {}) {
  if (!writes_sharded_safetensors(path, options)) {
    serialization::write_safetensors(path, specs, produce, options.metadata);
    return;
  }
  const uint64_t shard_bytes = options.max_shard_bytes > 0 ? options.max_shard_bytes : kDefaultSafetensorsShardBytes;
  const std::string text = path.string();
  const bool names_index = text.size() > 11 && text.compare(text.size() - 11, 11, ".index.json") == 0;
  if (names_index) {
    const auto directory = path.has_parent_path() ? path.parent_path() : std::filesystem::path(".");
    serialization::write_safetensors_sharded(directory, specs, produce, shard_bytes, options.metadata,
                                             path.filename().string());
  } else {
    serialization::write_safetensors_sharded(path, specs, produce, shard_bytes, options.metadata);
  }
}

/// @brief Writes the model's parameters and buffers as safetensors under their state_dict names
/// ("layer1.0.conv1.weight"), each in row-major order whatever its layout (a channels-last or
/// transposed tensor is written as `tensor.contiguous()`), copied to the CPU one at a time.
/// The form follows the path as in save_safetensors(specs, produce, path, options).
/// @param module the model
/// @param path a .safetensors file, a directory, or an ".index.json" path
/// @param options shard size and metadata
/// @throws trainloop::ConfigurationError for a tensor of a dtype safetensors cannot hold;
///         trainloop::CheckpointError naming the file that cannot be written.
inline void save_safetensors(const torch::nn::Module& module, const std::filesystem::path& path,
                             const SafetensorsSaveOptions& options = {}) {
  const StateDict state = module_state_dict(module);
  std::vector<serialization::SafetensorsSpec> specs;
  for (const auto& [name, tensor] : state) specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  save_safetensors(specs, [&](size_t i) { return state[i].second; }, path, options);
}

/// @brief Copies safetensors weights into the model's parameters and buffers of the same names,
/// reading one tensor at a time; each is copied into the model's tensor under NoGradGuard, which
/// keeps its device. Everything is checked against the file's header before anything is copied:
/// strict (the default), any missing or unexpected name or other shape is an error and the model
/// is unchanged; not strict, what fits is copied and the rest reported. A dtype that differs from
/// the model tensor's is an error either way (safetensors files say their dtype: a mismatch is
/// another model, or a conversion to make on purpose).
/// @param module the model
/// @param path a .safetensors file, an index (model.safetensors.index.json) or a directory
///        holding either (see serialization::SafetensorsSource)
/// @param options strict (the default) or not
/// @return what was loaded, and what did not fit when not strict
/// @throws trainloop::CheckpointError naming the file: unreadable or bad (see
///         SafetensorsFile), or, strict, not this model's (the first mismatch named).
inline LoadReport load_safetensors(torch::nn::Module& module, const std::filesystem::path& path, LoadOptions options = {}) {
  const serialization::SafetensorsSource source(path);
  const std::string where = "safetensors weights " + source.path().string();
  LoadReport report;
  StateDict targets;
  std::unordered_set<std::string> in_model;
  for (auto& [name, target] : module_state_dict(module)) {
    in_model.insert(name);
    if (!source.contains(name)) {
      report.missing.push_back(name);
      continue;
    }
    const auto& entry = source.entry(name);
    if (entry.dtype != target.scalar_type()) {
      throw CheckpointError(detail::concat("trainloop: ", where, " does not fit the model: tensor ",
                                           serialization::quote_untrusted(name), " is ", entry.dtype,
                                           " in the file; expected ", target.scalar_type(), " (the model's; nothing was loaded)"));
    }
    if (c10::IntArrayRef(entry.shape) != target.sizes()) {
      report.mismatched.push_back({name, entry.shape, target.sizes().vec()});
      continue;
    }
    targets.emplace_back(name, target);
  }
  for (const auto* entry : source.entries()) {
    if (!in_model.count(entry->name)) report.unexpected.push_back(entry->name);
  }
  if (options.strict && !report.complete()) throw CheckpointError(detail::mismatch_message(report, where, "in the file"));
  // Parameters are leaves that require grad: copying into them must not be recorded.
  torch::NoGradGuard no_grad;
  for (auto& [name, target] : targets) {
    target.copy_(source.read(name));
    report.loaded.push_back(name);
  }
  return report;
}

}  // namespace trainloop::interop
