#pragma once
/// @file
/// @brief Reading a checkpoint (checkpoint/checkpoint_file.hpp has its layout): the file is read
/// and its format checked at once; the model's and the optimizer's parts are checked against a
/// loop before anything is copied (checkpoint/restore.hpp applies them all or nothing).

#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/detail/history_io.hpp>
#include <trainloop/optim/optimizer_state.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/error.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/archive/torch_archive.hpp>
#include <trainloop/version.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// A checkpoint file opened for reading: the file is read and its format checked at once.
class CheckpointFile {
 public:
  /// Reads `path`, placing tensors on `device`.
  /// @throws trainloop::CheckpointError naming the file when it is missing, truncated or
  ///         corrupt, not a trainloop checkpoint, or of a newer format.
  CheckpointFile(std::filesystem::path path, std::optional<torch::Device> device) : path_(std::move(path)) {
    if (std::filesystem::is_directory(path_)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " is a directory without a .metadata "
                                   "file; expected a checkpoint file, or a per-rank checkpoint's directory (its "
                                   ".metadata, __<rank>_0.distcp files and trainloop.pt)"));
    }
    if (!std::filesystem::is_regular_file(path_)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(),
                                   " does not exist; expected a file written by trainloop (or \"last\")"));
    }
    // libtorch reads a checkpoint as a TorchScript archive (torch::jit::load), which compiles the
    // archive's code and runs its classes' __setstate__: a file from elsewhere is first proved to
    // hold no method and pickles of plain values only (serialization/archive/torch_archive.hpp).
    serialization::TorchArchive(path_, "expected a checkpoint written by trainloop", "checkpoint ").check_runs_no_code();
    c10::optional<torch::Device> where;  // c10::optional is std::optional in 2.x
    if (device) where = *device;
    try {
      archive_.load_from(path_.string(), where);
    } catch (const c10::Error& error) {
      std::throw_with_nested(CheckpointError(concat("trainloop: checkpoint ", path_.string(),
                                                    " is truncated or corrupt (libtorch cannot read it: ",
                                                    first_line(error), "); expected a complete checkpoint")));
    }
    if (!archive_.try_read(kCheckpointKey, ours_)) {
      throw CheckpointError(concat("trainloop: ", path_.string(), " holds no trainloop state (no '", kCheckpointKey,
                                   "' entry); expected a checkpoint written by trainloop, not a plain torch::save"));
    }
    header_.format_version = read_int(ours_, "format_version");
    if (header_.format_version > kCheckpointFormatVersion) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " has format version ",
                                   header_.format_version, ", written by a newer trainloop (",
                                   serialization::quote_untrusted(read_text(ours_, "trainloop_version")), "); this trainloop (", TRAINLOOP_VERSION_STRING,
                                   ") reads format versions up to ", kCheckpointFormatVersion,
                                   "; expected a checkpoint of this or an older trainloop"));
    }
    header_.trainloop_version = read_text(ours_, "trainloop_version");
    header_.mode = read_text(ours_, "mode");
    header_.world_size = read_int(ours_, "world_size");
    header_.batch_size = read_int(ours_, "batch_size");
  }

  /// The file read.
  const std::filesystem::path& path() const { return path_; }
  /// Format, writer and run that wrote it.
  const CheckpointHeader& header() const { return header_; }

  /// One tensor of the model and the checkpoint's value for it, checked to fit.
  struct TensorCopy {
    torch::Tensor target;  ///< the model's parameter or buffer
    torch::Tensor stored;  ///< the checkpoint's value, same shape and dtype
  };

  /// Checks every parameter and buffer of `model` against the checkpoint (present, same shape,
  /// same dtype) without changing anything, and returns the copies to make.
  /// @throws trainloop::CheckpointError naming the first parameter or buffer that is missing or
  ///         has another shape or dtype, with both.
  std::vector<TensorCopy> checked_model_tensors(torch::nn::Module& model) {
    std::vector<TensorCopy> copies;
    collect_module(model, archive_, "", copies);
    return copies;
  }

  /// Copies what checked_model_tensors() returned into the model (cannot fail on a shape).
  static void copy_model_tensors(const std::vector<TensorCopy>& copies) {
    torch::NoGradGuard no_grad;
    for (const auto& copy : copies) copy.target.copy_(copy.stored);
  }

  /// Checks that the checkpoint's optimizer state fits `optimizer` without changing it: as many
  /// parameter groups of the same sizes, and, for libtorch's per-parameter optimizers (SGD, Adam,
  /// AdamW, Adagrad, RMSprop), every per-parameter state tensor shaped like its parameter.
  /// With `engine_loads_own_layout` (the engine has its own loader, engine/optional_members.hpp), a
  /// state in another layout than libtorch's is left for that loader to check.
  /// @throws trainloop::CheckpointError naming the group, parameter or state entry that differs.
  void check_optimizer(const torch::optim::Optimizer& optimizer, bool engine_loads_own_layout = false) {
    torch::serialize::InputArchive saved, groups, states;
    if (!ours_.try_read("optimizer", saved)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " lacks the optimizer state; expected a ",
                                   "complete trainloop checkpoint"));
    }
    if (!saved.try_read("param_groups", groups)) {  // a sharded mode's own layout (engine/optional_members.hpp)
      if (engine_loads_own_layout) return;
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " holds the optimizer state in the layout ",
                                   "of gpu mode '", header_.mode, "', not libtorch's; expected this loop's mode to be '",
                                   header_.mode, "' (resume with the mode that wrote it)"));
    }
    torch::Tensor count;
    if (!groups.try_read("param_groups/size", count)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " lacks the optimizer's parameter groups; ",
                                   "expected a complete trainloop checkpoint"));
    }
    const auto& param_groups = optimizer.param_groups();
    const int64_t saved_groups = count.item<int64_t>();
    if (saved_groups != static_cast<int64_t>(param_groups.size())) {
      throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", path_.string(), " has ", saved_groups,
                                   " parameter groups and this optimizer ", param_groups.size(),
                                   "; expected the optimizer type and parameter groups that wrote it"));
    }
    const bool per_parameter = dynamic_cast<const torch::optim::SGD*>(&optimizer) != nullptr ||
                               dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr ||
                               dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr ||
                               dynamic_cast<const torch::optim::Adagrad*>(&optimizer) != nullptr ||
                               dynamic_cast<const torch::optim::RMSprop*>(&optimizer) != nullptr;
    const bool has_states = saved.try_read("state", states);
    for (int64_t g = 0; g < saved_groups; ++g) {
      torch::serialize::InputArchive group;
      torch::Tensor size;
      const auto params = param_groups[static_cast<size_t>(g)].params();
      if (!groups.try_read("param_groups/" + std::to_string(g), group) || !group.try_read("params/size", size) ||
          size.item<int64_t>() != static_cast<int64_t>(params.size())) {
        throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", path_.string(),
                                     " has a parameter group ", g, " of ", size.defined() ? size.item<int64_t>() : -1,
                                     " parameters and this optimizer's has ", params.size(),
                                     "; expected the optimizer type and parameter groups that wrote it"));
      }
      if (!per_parameter || !has_states) continue;
      for (size_t i = 0; i < params.size(); ++i) {
        c10::IValue key;
        torch::serialize::InputArchive state;
        if (!group.try_read("params/" + std::to_string(i), key) || !key.isString() ||
            !states.try_read(key.toStringRef(), state)) {
          continue;  // no state yet for this parameter (saved before its first step)
        }
        for (const auto& name : state.keys()) {
          torch::Tensor value;
          if (!state.try_read(name, value) || value.dim() == 0) continue;  // a step count, not per element
          if (value.sizes() != params[i].sizes()) {
            throw CheckpointError(concat("trainloop: the optimizer state in checkpoint ", path_.string(), " does not fit ",
                                         "this model: '", name, "' of parameter ", i, " in group ", g, " has shape ",
                                         value.sizes(), " in the checkpoint and the parameter ", params[i].sizes(),
                                         "; expected the optimizer of this model"));
          }
        }
      }
    }
  }

  /// Loads the optimizer's state, param-group options included; with `load`, the engine's own
  /// loader of the optimizer archive (a sharded mode's layout, engine/optional_members.hpp).
  void load_optimizer(torch::optim::Optimizer& optimizer,
                      const std::function<void(torch::optim::Optimizer&, torch::serialize::InputArchive&)>& load = {}) {
    torch::serialize::InputArchive optimizer_archive;
    ours_.read("optimizer", optimizer_archive);
    try {
      if (load) {
        load(optimizer, optimizer_archive);
      } else {
        load_optimizer_state(optimizer, optimizer_archive);
      }
    } catch (const c10::Error& error) {
      std::throw_with_nested(CheckpointError(concat("trainloop: the optimizer state in checkpoint ", path_.string(),
                                                    " does not fit this optimizer (", first_line(error),
                                                    "); expected the optimizer type and parameter groups that wrote it")));
    }
  }

  /// The training progress the checkpoint recorded.
  TrainingProgress progress() {
    torch::serialize::InputArchive a;
    ours_.read("progress", a);
    TrainingProgress p;
    p.history = history_from_text(read_text(a, "history"));
    p.epochs_completed = read_int(a, "epochs_completed");
    p.global_step = read_int(a, "global_step");
    p.history.total_steps = p.global_step;
    p.samples_into_epoch = static_cast<uint64_t>(read_int(a, "samples_into_epoch"));
    p.batches_into_epoch = read_int(a, "batches_into_epoch");
    p.steps_into_epoch = read_int(a, "steps_into_epoch");
    p.seconds_into_epoch = read_double(a, "seconds_into_epoch");
    c10::IValue data_wait;  // absent in older checkpoints: counted from the resume
    if (a.try_read("data_wait_into_epoch", data_wait)) p.data_wait_into_epoch = data_wait.toDouble();
    torch::Tensor totals;
    if (a.try_read("partial_totals", totals)) p.partial_totals = totals.to(torch::kCPU);
    c10::IValue partial;
    if (a.try_read("partial_record", partial)) {
      History history = history_from_text(partial.toStringRef());
      if (!history.epochs.empty()) p.partial_record = history.epochs.front();
    }
    p.sampler_seed = static_cast<uint64_t>(read_int(a, "sampler_seed"));
    p.seeded = read_int(a, "seeded") != 0;
    p.fit_first_epoch = read_int(a, "fit_first_epoch");
    p.fit_first_step = read_int(a, "fit_first_step");
    p.fit_epoch_count = read_int(a, "fit_epoch_count");
    p.fit_step_count = read_int(a, "fit_step_count");
    p.fit_finished = read_int(a, "fit_finished") != 0;
    torch::Tensor scaler;
    if (a.try_read("grad_scaler", scaler)) p.grad_scaler_state = scaler.to(torch::kCPU);
    return p;
  }

  /// Restores each component's state from the checkpoint. A component with state whose key the
  /// checkpoint lacks is an error naming the key and the keys present, unless its state is
  /// optional (it then keeps its state). Not all or nothing by itself: restore_checkpoint()
  /// (checkpoint/restore.hpp) rolls back on a failure.
  void load_states(const KeyedStates& components) {
    torch::serialize::InputArchive all;
    const bool any = ours_.try_read("callbacks", all);
    for (const auto& [key, component] : components) {
      torch::serialize::InputArchive one;
      if (any && all.try_read(key, one)) {
        component->load_state(one);
        continue;
      }
      if (component->state_optional() || !detail::has_state(*component)) continue;
      std::vector<std::string> present = any ? all.keys() : std::vector<std::string>{};
      std::string listed;
      for (size_t i = 0; i < present.size() && i < 16; ++i) listed += (i == 0 ? "" : ", ") + serialization::quote_untrusted(present[i]);
      if (present.size() > 16) listed += concat(" and ", present.size() - 16, " more");
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " holds no state for callback \"", key,
                                   "\"; it holds the states of: ", listed.empty() ? "none" : listed,
                                   ". Expected a checkpoint written with that callback, or a callback whose "
                                   "state_optional() is true"));
    }
  }
  /// Rank `rank`'s random number generator state, if the checkpoint has one for it.
  std::optional<torch::Tensor> rng_state(int64_t rank) {
    torch::serialize::InputArchive rng;
    if (!ours_.try_read("rng", rng)) return std::nullopt;
    torch::Tensor state;
    if (!rng.try_read("rank" + std::to_string(rank), state)) return std::nullopt;
    return state.to(torch::kCPU);
  }

 private:
  static std::string first_line(const c10::Error& error) {
    std::string text = error.what_without_backtrace();
    return text.substr(0, text.find('\n'));
  }

  int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key) const {
    return read_value(archive, key).toInt();
  }
  double read_double(torch::serialize::InputArchive& archive, const std::string& key) const {
    return read_value(archive, key).toDouble();
  }
  std::string read_text(torch::serialize::InputArchive& archive, const std::string& key) const {
    return read_value(archive, key).toStringRef();
  }
  c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key) const {
    c10::IValue value;
    if (!archive.try_read(key, value)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " lacks '", key,
                                   "'; expected a complete trainloop checkpoint"));
    }
    return value;
  }

  /// Module::load's walk, checking instead of copying: reads every parameter, buffer and child
  /// exactly where Module::save wrote it and checks its shape and dtype against the model's.
  void collect_module(torch::nn::Module& module, torch::serialize::InputArchive& archive, const std::string& prefix,
                      std::vector<TensorCopy>& copies) {
    auto check_tensor = [&](const std::string& name, const torch::Tensor& target, bool is_buffer, const char* kind) {
      torch::Tensor stored;
      if (!archive.try_read(name, stored, is_buffer)) {
        throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " has no ", kind, " '", prefix + name,
                                     "'", target.defined() ? concat(" of shape ", target.sizes()) : std::string(),
                                     "; expected a checkpoint of this model"));
      }
      if (!target.defined()) return;
      if (stored.sizes() != target.sizes()) {
        throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " does not fit this model: ", kind,
                                     " '", prefix + name, "' has shape ", stored.sizes(), " in the checkpoint and ",
                                     target.sizes(), " in the model; expected a checkpoint of this model"));
      }
      if (stored.scalar_type() != target.scalar_type()) {
        throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " does not fit this model: ", kind,
                                     " '", prefix + name, "' has dtype ", stored.scalar_type(), " in the checkpoint and ",
                                     target.scalar_type(), " in the model; expected a checkpoint of this model"));
      }
      copies.push_back({target, stored});
    };
    for (const auto& item : module.named_parameters(/*recurse=*/false)) check_tensor(item.key(), item.value(), false, "parameter");
    for (const auto& item : module.named_buffers(/*recurse=*/false)) check_tensor(item.key(), item.value(), true, "buffer");
    for (const auto& child : module.named_children()) {
      if (!child.value()->is_serializable()) continue;
      torch::serialize::InputArchive child_archive;
      if (!archive.try_read(child.key(), child_archive)) {
        throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " has no submodule '",
                                     prefix + child.key(), "'; expected a checkpoint of this model"));
      }
      collect_module(*child.value(), child_archive, prefix + child.key() + ".", copies);
    }
  }

  std::filesystem::path path_;
  torch::serialize::InputArchive archive_;
  torch::serialize::InputArchive ours_;
  CheckpointHeader header_;
};

}  // namespace trainloop::detail
