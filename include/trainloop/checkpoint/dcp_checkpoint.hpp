#pragma once
/// @file
/// @brief Per-rank checkpoints: a directory in torch.distributed.checkpoint's layout (DCP, as
/// torch 2.11's FileSystemWriter writes it: serialization/dcp/), which the sharded modes write
/// without gathering anything and every mode and world size reads.
///
/// Layout of `epoch=0003-step=000120.ckpt/`:
/// - `__<rank>_0.distcp`, one per rank: its shares (checkpoint/checkpoint_shares.hpp) of the
///   parameters, `model.<name>`, and of the optimizer state, `optim.state.<name>.<field>`, each a
///   flat run of elements stored as DCP boxes; rank 0's also holds the tensors no rank shards
///   (buffers, parameters the optimizer does not step), whole;
/// - `.metadata`: DCP's Metadata (a pickle Python's `dcp.load` reads), written last by rank 0;
/// - `trainloop.pt`: everything else a resume needs, in checkpoint/checkpoint_file.hpp's format
///   without the model: the header, the optimizer's param groups and options (its state is in
///   the .distcp files), the progress, the callbacks' states and every rank's random streams.
///   Python's DCP ignores the file.
///
/// So in Python, one process without a process group reads the weights (and the optimizer's
/// per-parameter state):
/// `dcp.load({"model": model.state_dict()}, checkpoint_id="epoch=0003-step=000120.ckpt")`.
/// The step counter is stored as a 0-d float64 tensor (Python's optimizers hold a 0-d float32:
/// DCP copies it in).

#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/optim/param_state_fields.hpp>
#include <trainloop/serialization/dcp/distcp_reader.hpp>
#include <trainloop/serialization/dcp/distcp_writer.hpp>
#include <trainloop/serialization/dcp/flat_range_boxes.hpp>
#include <trainloop/serialization/dcp/metadata.hpp>
#include <trainloop/serialization/dcp/metadata_file.hpp>
#include <trainloop/serialization/dcp/metadata_parse.hpp>
#include <trainloop/serialization/dcp/metadata_pickle.hpp>
#include <trainloop/detail/torch_compat.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <filesystem>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// The file of a per-rank checkpoint holding the loop's own state (the file comment).
inline constexpr const char* kDcpLoopStateFile = "trainloop.pt";

/// A run of a tensor stored in another memory order (channels_last): in that order it is a
/// row-major run of the permuted tensor, so it is the permuted tensor's boxes; each box, permuted
/// back, is a box of the tensor.
inline void add_run_in_memory_order(serialization::dcp::DistcpWriter& writer, const TensorShare& share,
                                    const torch::Tensor& values) {
  const size_t dims = share.size.size();
  std::vector<int64_t> permuted(dims), inverse(dims);
  for (size_t i = 0; i < dims; ++i) {
    permuted[i] = share.size[static_cast<size_t>(share.memory_order[i])];
    inverse[static_cast<size_t>(share.memory_order[i])] = static_cast<int64_t>(i);
  }
  int64_t at = 0;
  for (const auto& [offsets, sizes] : serialization::dcp::flat_range_boxes(permuted, share.begin, share.begin + values.numel())) {
    int64_t count = 1;
    for (int64_t extent : sizes) count *= extent;
    std::vector<int64_t> box_offsets(dims);
    for (size_t i = 0; i < dims; ++i) box_offsets[static_cast<size_t>(share.memory_order[i])] = offsets[i];
    writer.add_tensor_chunk(share.key, values.narrow(0, at, count).view(sizes).permute(inverse).contiguous(), box_offsets,
                            share.size);
    at += count;
  }
}

/// Writes this rank's file of a per-rank checkpoint into `directory`: its `shares` and the
/// tensors it writes `whole` (rank 0: what no rank shards), fsynced; returns its part of the
/// metadata.
inline serialization::dcp::Metadata write_rank_file(const std::filesystem::path& directory, int rank,
                                                   const std::vector<TensorShare>& shares,
                                                   const std::vector<std::pair<std::string, torch::Tensor>>& whole) {
  serialization::dcp::DistcpWriter writer(directory, rank);
  for (const TensorShare& share : shares) {
    const torch::Tensor values = share.values.detach().to(torch::kCPU);
    if (share.size.empty()) {
      writer.add_tensor_chunk(share.key, values.reshape({}), {}, {});
    } else if (share.memory_order.empty()) {
      writer.add_flat_range(share.key, values, share.begin, share.size);
    } else {
      add_run_in_memory_order(writer, share, values);
    }
  }
  for (const auto& [key, tensor] : whole) {
    const torch::Tensor values = tensor.detach().to(torch::kCPU).contiguous();
    writer.add_tensor_chunk(key, values, std::vector<int64_t>(static_cast<size_t>(values.dim()), 0), values.sizes().vec());
  }
  return writer.finish();
}

/// Python's nested path of a key this file writes (Metadata.planner_data, which `dcp.load` into
/// an empty dict follows): `model.<name>` is {"model", name}; `optim.state.<name>.<field>` is
/// {"optim", "state", name, field}.
inline std::vector<std::string> planner_path_of(const std::string& key) {
  if (key.rfind("optim.state.", 0) == 0) {
    const std::string rest = key.substr(12);
    const auto dot = rest.rfind('.');
    if (dot != std::string::npos) return {"optim", "state", rest.substr(0, dot), rest.substr(dot + 1)};
  }
  const auto dot = key.find('.');
  if (dot == std::string::npos) return {key};
  return {key.substr(0, dot), key.substr(dot + 1)};
}

/// @brief This rank's part of a per-rank checkpoint: writes its file into `directory`
/// (write_rank_file) and returns its part of the metadata as bytes the loop carries to rank 0
/// without reading them (write_checkpoint_metadata takes them back).
inline std::string write_rank_part(const std::filesystem::path& directory, int rank, const std::vector<TensorShare>& shares,
                                   const std::vector<std::pair<std::string, torch::Tensor>>& whole) {
  return serialization::dcp::metadata_pickle(write_rank_file(directory, rank, shares, whole));
}

/// @brief Rank 0: merges every rank's part (write_rank_part's bytes, in rank order) and writes the
/// checkpoint's `.metadata` into `directory`, fsynced. `checkpoint` names the checkpoint in errors.
/// @throws trainloop::CheckpointError when a part does not parse or the parts overlap.
inline void write_checkpoint_metadata(const std::filesystem::path& directory, const std::vector<std::string>& parts,
                                      const std::string& checkpoint) {
  std::vector<serialization::dcp::Metadata> metadata;
  for (size_t r = 0; r < parts.size(); ++r) {
    metadata.push_back(serialization::dcp::parse_metadata(parts[r], concat("rank ", r, "'s part of ", checkpoint), /*complete=*/false));
  }
  serialization::dcp::Metadata merged = serialization::dcp::merge_metadata(metadata);
  for (const auto& [key, entry] : merged.tensors) merged.planner_data[key] = planner_path_of(key);
  serialization::dcp::write_metadata(directory, merged);
}

/// @brief A per-rank checkpoint opened for reading (the file comment): its metadata read and
/// checked at once (every file it names present, every item inside its file), tensors read on
/// demand, each rank reading only the ranges it asks for (ShareSource).
class DcpCheckpoint final : public ShareSource {
 public:
  /// @throws trainloop::CheckpointError naming the directory or file that is missing or corrupt.
  explicit DcpCheckpoint(std::filesystem::path directory)
      : directory_(std::move(directory)), metadata_(serialization::dcp::read_metadata(directory_)),
        reader_(directory_, metadata_) {}

  /// The directory.
  const std::filesystem::path& path() const { return directory_; }
  /// Its metadata.
  const serialization::dcp::Metadata& metadata() const { return metadata_; }
  /// Whether it holds trainloop's state (a trainloop checkpoint), not only tensors (Python's dcp.save).
  bool has_loop_state() const {
    std::error_code ignored;
    return std::filesystem::is_regular_file(directory_ / kDcpLoopStateFile, ignored);
  }

  bool has(const std::string& key) const override { return metadata_.tensors.count(key) > 0; }
  torch::Tensor read_range(const std::string& key, int64_t begin, int64_t end) override {
    return reader_.read_flat_range(entry(key), begin, end);
  }
  torch::Tensor read_whole(const std::string& key) override {
    const auto& found = entry(key);
    int64_t numel = 1;
    for (int64_t extent : found.size) numel *= extent;
    return reader_.read_flat_range(found, 0, numel).reshape(found.size);
  }

  /// Checks that every parameter and buffer of `module` is stored under `prefix` + its name with
  /// its sizes and dtype, changing nothing.
  /// @throws trainloop::CheckpointError naming the first that is missing or differs, with both.
  void check_model(torch::nn::Module& module, const std::string& prefix = "model.") const {
    for_each_model_tensor(module, [&](const std::string& name, const torch::Tensor& target, const char* kind) {
      auto found = metadata_.tensors.find(prefix + name);
      if (found == metadata_.tensors.end()) {
        throw CheckpointError(concat("trainloop: checkpoint ", directory_.string(), " has no ", kind, " '", name,
                                     "' of shape ", target.sizes(), " (no '", prefix, name,
                                     "' in its .metadata); expected a checkpoint of this model"));
      }
      if (c10::IntArrayRef(found->second.size) != target.sizes()) {
        throw CheckpointError(concat("trainloop: checkpoint ", directory_.string(), " does not fit this model: ", kind,
                                     " '", name, "' has shape ", c10::IntArrayRef(found->second.size),
                                     " in the checkpoint and ", target.sizes(), " in the model; expected a checkpoint of "
                                     "this model"));
      }
      if (found->second.dtype != target.scalar_type()) {
        throw CheckpointError(concat("trainloop: checkpoint ", directory_.string(), " does not fit this model: ", kind,
                                     " '", name, "' has dtype ", found->second.dtype, " in the checkpoint and ",
                                     target.scalar_type(), " in the model; expected a checkpoint of this model"));
      }
    });
  }
  /// Copies every parameter and buffer in, one tensor at a time (the memory it takes beyond the
  /// model's: the largest tensor). Call check_model() first.
  void load_model(torch::nn::Module& module, const std::string& prefix = "model.") {
    torch::NoGradGuard no_grad;
    for_each_model_tensor(module, [&](const std::string& name, const torch::Tensor& target, const char*) {
      torch::Tensor copy = target;  // a handle: copy_ writes into the model's memory
      copy.copy_(read_whole(prefix + name));
    });
  }

  /// Checks the stored optimizer state of every parameter `optimizer` steps against it (each
  /// field's sizes are the parameter's), changing nothing.
  /// @throws trainloop::CheckpointError naming the first field that differs, or an optimizer whose
  ///         state this layout cannot hold (not SGD, Adam, AdamW, Adagrad or RMSprop).
  void check_optimizer_states(const torch::optim::Optimizer& optimizer, const torch::nn::Module& module) const {
    const bool stored = std::any_of(metadata_.tensors.begin(), metadata_.tensors.end(),
                                    [](const auto& item) { return item.first.rfind("optim.state.", 0) == 0; });
    if (!stored) return;
    if (!optim::has_named_state_fields(optimizer)) {
      throw CheckpointError(concat("trainloop: checkpoint ", directory_.string(), " holds optimizer state this "
                                   "optimizer cannot take (only SGD's, Adam's, AdamW's, Adagrad's and RMSprop's "
                                   "per-parameter state is named in a per-rank checkpoint); expected one of those"));
    }
    const auto keys = parameter_keys(module);
    auto probe = optim::new_param_state(optimizer);
    for_each_stepped(optimizer, keys, [&](const torch::Tensor& parameter, const std::string& key) {
      for (auto& [field, unused] : optim::named_elementwise_fields(*probe)) {
        auto found = metadata_.tensors.find(state_share_key(key, field));
        if (found == metadata_.tensors.end() || c10::IntArrayRef(found->second.size) == parameter.sizes()) continue;
        throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", directory_.string(), " does not fit "
                                     "this model: '", found->first, "' has shape ", c10::IntArrayRef(found->second.size),
                                     " and the parameter ", parameter.sizes(), "; expected the optimizer of this model"));
      }
      // The step count is one number (a crafted one of 3 elements failed inside libtorch at resume).
      const auto step = metadata_.tensors.find(state_share_key(key, "step"));
      if (step != metadata_.tensors.end() && serialization::dcp::checked_numel(step->second.size) != 1) {
        throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", directory_.string(), " has '",
                                     step->first, "' of shape ", c10::IntArrayRef(step->second.size),
                                     "; expected one number (the optimizer's step count)"));
      }
    });
  }
  /// Reads every stepped parameter's whole state into `optimizer` (the replicated modes, which
  /// hold it whole anyway), one field at a time.
  void load_whole_optimizer_states(torch::optim::Optimizer& optimizer, const torch::nn::Module& module) {
    if (!optim::has_named_state_fields(optimizer)) return;  // check_optimizer_states refused a stored state
    const auto keys = parameter_keys(module);
    auto& state = optimizer.state();
    for_each_stepped(optimizer, keys, [&](const torch::Tensor& parameter, const std::string& key) {
      auto loaded = optim::new_param_state(optimizer);
      bool any = false;
      for (auto& [field, tensor] : optim::named_elementwise_fields(*loaded)) {
        if (!has(state_share_key(key, field))) continue;
        *tensor = torch::empty_like(parameter).copy_(read_whole(state_share_key(key, field)));
        any = true;
      }
      if (!any) return;
      if (const std::string step = state_share_key(key, "step"); has(step)) {
        const double count = read_whole(step).item<double>();
        if (!(count >= 0.0 && count <= 9007199254740992.0)) {  // 2^53: every count a double holds exactly
          throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", directory_.string(), " has '", step,
                                       "' = ", count, "; expected a step count from 0 to 2^53"));
        }
        optim::set_state_step(*loaded, static_cast<int64_t>(count));
      }
      state[optimizer_state_key(state, parameter)] = std::move(loaded);
    });
  }

 private:
  const serialization::dcp::TensorEntry& entry(const std::string& key) const {
    auto found = metadata_.tensors.find(key);
    if (found == metadata_.tensors.end()) {
      throw CheckpointError(concat("trainloop: checkpoint ", directory_.string(), " has no tensor '", key,
                                   "' in its .metadata; expected a checkpoint of this model"));
    }
    return found->second;
  }
  /// f(name, tensor, "parameter" or "buffer") for each of `module`'s tensors, a tied one once.
  template <class F>
  static void for_each_model_tensor(torch::nn::Module& module, F&& f) {
    std::unordered_set<const void*> seen;
    for (const auto& item : module.named_parameters()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) f(item.key(), item.value(), "parameter");
    }
    for (const auto& item : module.named_buffers()) {
      if (seen.insert(item.value().unsafeGetTensorImpl()).second) f(item.key(), item.value(), "buffer");
    }
  }
  /// f(parameter, its key) for each distinct parameter `optimizer` steps.
  template <class F>
  void for_each_stepped(const torch::optim::Optimizer& optimizer, const std::unordered_map<const void*, std::string>& keys,
                        F&& f) const {
    std::unordered_set<const void*> seen;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        if (!seen.insert(parameter.unsafeGetTensorImpl()).second) continue;
        auto key = keys.find(parameter.unsafeGetTensorImpl());
        if (key == keys.end()) {
          throw CheckpointError(concat("trainloop: a parameter of the optimizer (sizes ", parameter.sizes(), ") is not "
                                       "one of the model's, so checkpoint ", directory_.string(), " cannot name its "
                                       "state; expected the optimizer to hold only the model's parameters"));
        }
        f(parameter, key->second);
      }
    }
  }

  std::filesystem::path directory_;
  serialization::dcp::Metadata metadata_;
  serialization::dcp::DistcpReader reader_;
};

}  // namespace trainloop::detail
