#pragma once
/// @file
/// @brief The checkpoint file: a plain libtorch archive holding the model, and everything else
/// needed to resume exactly under one key of its own.
///
/// Layout (torch::serialize archive, the zip format of torch::save):
/// - the model's parameters and buffers at the top, exactly as `torch::save(model, path)` writes
///   them, so a program without trainloop loads the weights with `torch::load(model, path)`;
/// - `__trainloop__/`: `format_version`, `trainloop_version`, `mode` and `world_size` of the run
///   that wrote it, `batch_size`; `optimizer/` (libtorch's format, param-group options included);
///   `progress/` (epochs, global step, position inside the epoch, the History, the sampler seed,
///   the partial epoch's metric sums of every rank); `callbacks/<key>/` (each callback's
///   save_state()); `rng/rank<r>` (every rank's CPU and CUDA generator states).
///
/// Written atomically (detail/atomic_file.hpp): a kill at any moment leaves the previous file.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/history_io.hpp>
#include <trainloop/detail/optimizer_state.hpp>
#include <trainloop/detail/training_progress.hpp>
#include <trainloop/error.hpp>
#include <trainloop/version.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief The checkpoint format this trainloop writes; it reads this one and older ones.
inline constexpr int64_t kCheckpointFormatVersion = 1;

namespace detail {

inline constexpr const char* kCheckpointKey = "__trainloop__";

/// A callback with the key its state is stored under.
using KeyedCallbacks = std::vector<std::pair<std::string, Callback*>>;

/// Keys for `callbacks`: state_key(), with "#2", "#3"... for repeats, in order.
inline KeyedCallbacks keyed_callbacks(const CallbackList& callbacks) {
  KeyedCallbacks keyed;
  std::map<std::string, int> seen;
  for (const auto& callback : callbacks) {
    std::string key = callback->state_key();
    const int count = ++seen[key];
    if (count > 1) key += "#" + std::to_string(count);
    keyed.emplace_back(std::move(key), callback.get());
  }
  return keyed;
}

/// What a checkpoint holds besides the model and optimizer.
struct CheckpointHeader {
  int64_t format_version = kCheckpointFormatVersion;  ///< format of the file
  std::string trainloop_version;                      ///< the trainloop that wrote it
  std::string mode;                                   ///< "single", "dp" or "ddp"
  int64_t world_size = 1;                             ///< ranks of the run that wrote it
  int64_t batch_size = 0;                             ///< per-process batch size of that run
};

inline void write_int(torch::serialize::OutputArchive& archive, const std::string& key, int64_t value) {
  archive.write(key, c10::IValue(value));
}
inline void write_double(torch::serialize::OutputArchive& archive, const std::string& key, double value) {
  archive.write(key, c10::IValue(value));
}
inline void write_text(torch::serialize::OutputArchive& archive, const std::string& key, const std::string& value) {
  archive.write(key, c10::IValue(value));
}

inline void write_progress(torch::serialize::OutputArchive& archive, const TrainingProgress& p) {
  write_text(archive, "history", history_to_text(p.history));
  write_int(archive, "epochs_completed", p.epochs_completed);
  write_int(archive, "global_step", p.global_step);
  write_int(archive, "samples_into_epoch", static_cast<int64_t>(p.samples_into_epoch));
  write_int(archive, "batches_into_epoch", p.batches_into_epoch);
  write_int(archive, "steps_into_epoch", p.steps_into_epoch);
  write_double(archive, "seconds_into_epoch", p.seconds_into_epoch);
  if (p.partial_totals.defined()) archive.write("partial_totals", p.partial_totals);
  if (p.partial_record) {
    History partial;
    partial.epochs.push_back(*p.partial_record);
    write_text(archive, "partial_record", history_to_text(partial));
  }
  write_int(archive, "sampler_seed", static_cast<int64_t>(p.sampler_seed));
  write_int(archive, "seeded", p.seeded ? 1 : 0);
  write_int(archive, "fit_first_epoch", p.fit_first_epoch);
  write_int(archive, "fit_first_step", p.fit_first_step);
  write_int(archive, "fit_epoch_count", p.fit_epoch_count);
  write_int(archive, "fit_step_count", p.fit_step_count);
  write_int(archive, "fit_finished", p.fit_finished ? 1 : 0);
  if (p.grad_scaler_state.defined()) archive.write("grad_scaler", p.grad_scaler_state);
}

/// Writes a checkpoint to `path` atomically. `rng_per_rank[r]` is rank r's capture_rng_state().
/// @throws trainloop::CheckpointError naming `path` and the system's reason when it cannot be
///         written (disk full, read-only); no partial file is left and an earlier one is unchanged.
inline void write_checkpoint(const std::filesystem::path& path, const torch::nn::Module& model,
                             const torch::optim::Optimizer& optimizer, const TrainingProgress& progress,
                             const KeyedCallbacks& callbacks, const std::vector<torch::Tensor>& rng_per_rank,
                             const CheckpointHeader& header) {
  torch::serialize::OutputArchive archive;
  model.save(archive);
  torch::serialize::OutputArchive ours;
  write_int(ours, "format_version", kCheckpointFormatVersion);
  write_text(ours, "trainloop_version", header.trainloop_version);
  write_text(ours, "mode", header.mode);
  write_int(ours, "world_size", header.world_size);
  write_int(ours, "batch_size", header.batch_size);
  torch::serialize::OutputArchive optimizer_archive;
  save_optimizer_state(optimizer, optimizer_archive);
  ours.write("optimizer", optimizer_archive);
  torch::serialize::OutputArchive progress_archive;
  write_progress(progress_archive, progress);
  ours.write("progress", progress_archive);
  torch::serialize::OutputArchive callbacks_archive;
  for (const auto& [key, callback] : callbacks) {
    torch::serialize::OutputArchive one;
    callback->save_state(one);
    callbacks_archive.write(key, one);
  }
  ours.write("callbacks", callbacks_archive);
  torch::serialize::OutputArchive rng_archive;
  write_int(rng_archive, "ranks", static_cast<int64_t>(rng_per_rank.size()));
  for (size_t r = 0; r < rng_per_rank.size(); ++r) rng_archive.write("rank" + std::to_string(r), rng_per_rank[r]);
  ours.write("rng", rng_archive);
  archive.write(kCheckpointKey, ours);

  // Streamed through a writer trainloop checks itself (see BasicAtomicFile::writer): a full disk
  // is a CheckpointError naming the file and the system's reason, not an abort inside libtorch.
  BasicAtomicFile<CheckpointError> file(path, "the checkpoint");
  try {
    archive.save_to(file.writer());
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(concat("trainloop: cannot write the checkpoint ", path.string(), ": ",
                                                  error.what_without_backtrace(), "; expected a writable directory with "
                                                  "free space (the previous checkpoint is unchanged)")));
  }
  file.commit();
}

/// A checkpoint file opened for reading: the file is read and its format checked at once.
class CheckpointFile {
 public:
  /// Reads `path`, placing tensors on `device`.
  /// @throws trainloop::CheckpointError naming the file when it is missing, truncated or
  ///         corrupt, not a trainloop checkpoint, or of a newer format.
  CheckpointFile(std::filesystem::path path, std::optional<torch::Device> device) : path_(std::move(path)) {
    if (!std::filesystem::is_regular_file(path_)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(),
                                   " does not exist; expected a file written by trainloop (or \"last\")"));
    }
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
                                   read_text(ours_, "trainloop_version"), "); this trainloop (", TRAINLOOP_VERSION_STRING,
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

  /// Copies the checkpoint's parameters and buffers into `model`, all or nothing.
  /// @throws trainloop::CheckpointError (see checked_model_tensors()); the model is unchanged then.
  void load_model(torch::nn::Module& model) { copy_model_tensors(checked_model_tensors(model)); }

  /// Checks that the checkpoint's optimizer state fits `optimizer` without changing it: as many
  /// parameter groups of the same sizes, and, for libtorch's per-parameter optimizers (SGD, Adam,
  /// AdamW, Adagrad, RMSprop), every per-parameter state tensor shaped like its parameter.
  /// @throws trainloop::CheckpointError naming the group, parameter or state entry that differs.
  void check_optimizer(const torch::optim::Optimizer& optimizer) {
    torch::serialize::InputArchive saved, groups, states;
    if (!ours_.try_read("optimizer", saved) || !saved.try_read("param_groups", groups)) {
      throw CheckpointError(concat("trainloop: checkpoint ", path_.string(), " lacks the optimizer state; expected a ",
                                   "complete trainloop checkpoint"));
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

  /// Loads the optimizer's state, param-group options included.
  void load_optimizer(torch::optim::Optimizer& optimizer) {
    torch::serialize::InputArchive optimizer_archive;
    ours_.read("optimizer", optimizer_archive);
    try {
      load_optimizer_state(optimizer, optimizer_archive);
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

  /// Restores each callback whose key the checkpoint has (others keep their state). Not all or
  /// nothing by itself: restore_checkpoint() (checkpoint/restore.hpp) rolls back on a failure.
  void load_callbacks(const KeyedCallbacks& callbacks) {
    torch::serialize::InputArchive all;
    if (!ours_.try_read("callbacks", all)) return;
    for (const auto& [key, callback] : callbacks) {
      torch::serialize::InputArchive one;
      if (all.try_read(key, one)) callback->load_state(one);
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

}  // namespace detail
}  // namespace trainloop
