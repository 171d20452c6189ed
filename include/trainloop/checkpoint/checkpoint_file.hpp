#pragma once
/// @file
/// @brief The checkpoint file: a plain libtorch archive holding the model, and everything else
/// needed to resume exactly under one key of its own.
///
/// Layout (torch::serialize archive, the zip format of torch::save):
/// - the model's parameters and buffers at the top, exactly as `torch::save(model, path)` writes
///   them, so a program without trainloop loads the weights with `torch::load(model, path)`;
/// - `__trainloop__/`: `format_version`, `trainloop_version`, `mode` and `world_size` of the run
///   that wrote it, `batch_size`; `optimizer/` (libtorch's format, param-group options included, or a
///   sharded mode's own layout: engine/optional_members.hpp);
///   `progress/` (epochs, global step, position inside the epoch, the History, the sampler seed,
///   the partial epoch's metric sums of every rank); `callbacks/<key>/` (each callback's
///   save_state()); `rng/rank<r>` (every rank's CPU and CUDA generator states).
///
/// Written atomically (detail/atomic_file.hpp): a kill at any moment leaves the previous file.
/// Read by CheckpointFile (checkpoint/checkpoint_reader.hpp).

#include <trainloop/checkpoint/code_safe_names.hpp>
#include <trainloop/checkpoint/stateful.hpp>
#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/detail/history_io.hpp>
#include <trainloop/checkpoint/training_progress.hpp>
#include <trainloop/error.hpp>
#include <trainloop/version.hpp>

#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <functional>
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
  write_double(archive, "data_wait_into_epoch", p.data_wait_into_epoch);
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

/// The archive a checkpoint file holds (the file comment's layout): the model as `save_model` writes
/// it into the top level (Module::save, or checkpoint/module_snapshot.hpp's copy of it), the rest
/// under `__trainloop__`. The archive refers to the tensors it was given; each callback's state is
/// taken now.
/// @throws trainloop::CheckpointError when a name cannot be stored (code_safe_names.hpp).
inline torch::serialize::OutputArchive checkpoint_archive(
    const torch::nn::Module& model, const std::function<void(torch::serialize::OutputArchive&)>& save_model,
    torch::serialize::OutputArchive& optimizer, const TrainingProgress& progress, const KeyedStates& callbacks,
    const std::vector<torch::Tensor>& rng_per_rank, const CheckpointHeader& header, const std::filesystem::path& path) {
  std::vector<std::string> keys;
  for (const auto& entry : callbacks) keys.push_back(entry.first);
  check_names_fit_checkpoint_code(model, keys, path);
  torch::serialize::OutputArchive archive;
  save_model(archive);
  torch::serialize::OutputArchive ours;
  write_int(ours, "format_version", kCheckpointFormatVersion);
  write_text(ours, "trainloop_version", header.trainloop_version);
  write_text(ours, "mode", header.mode);
  write_int(ours, "world_size", header.world_size);
  write_int(ours, "batch_size", header.batch_size);
  ours.write("optimizer", optimizer);
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
  return archive;
}

/// Writes `archive` to `path` atomically: streamed into a temporary file next to it, then fsynced
/// and renamed. `streamed` (when given) runs once every tensor's bytes are in the temporary file —
/// from then on the archive's tensors may change (a checkpoint written behind training). `stop`
/// (when given), once set, stops the writing and the file is not committed.
inline void save_checkpoint_archive(torch::serialize::OutputArchive& archive, const std::filesystem::path& path,
                                    const std::function<void()>& streamed = {}, const std::atomic<bool>* stop = nullptr) {
  // Streamed through a writer trainloop checks itself (see BasicAtomicFile::writer): a full disk
  // is a CheckpointError naming the file and the system's reason, not an abort inside libtorch.
  BasicAtomicFile<CheckpointError> file(path, "the checkpoint");
  std::function<size_t(const void*, size_t)> write = file.writer();
  if (stop != nullptr) {
    // Stopped: the rest is not written, only passed over (libtorch still sums its CRC) and the
    // file is not committed. Not a short write: libtorch's zip writer then fails again in its
    // destructor, which terminates the process (tried on 2.15).
    write = [write, stop](const void* data, size_t size) -> size_t { return stop->load() ? size : write(data, size); };
  }
  try {
    archive.save_to(write);
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(concat("trainloop: cannot write the checkpoint ", path.string(), ": ",
                                                  error.what_without_backtrace(), "; expected a writable directory with "
                                                  "free space (the previous checkpoint is unchanged)")));
  }
  if (stop != nullptr && stop->load()) {
    throw CheckpointError(concat("trainloop: the checkpoint ", path.string(), " was not written: its write was cancelled "
                                 "(fit() ended with an error); the previous checkpoints are unchanged"));
  }
  if (streamed) streamed();
  file.commit();
}

/// Writes a checkpoint to `path` atomically. `optimizer` is the optimizer's state as the engine
/// saved it (libtorch's format for every built-in mode; engine/optional_members.hpp);
/// `rng_per_rank[r]` is rank r's capture_rng_state().
/// @throws trainloop::CheckpointError naming `path` and the system's reason when it cannot be
///         written (disk full, read-only), or a name its code cannot carry (code_safe_names.hpp);
///         no partial file is left and an earlier one is unchanged.
inline void write_checkpoint(const std::filesystem::path& path, const torch::nn::Module& model,
                             torch::serialize::OutputArchive& optimizer, const TrainingProgress& progress,
                             const KeyedStates& callbacks, const std::vector<torch::Tensor>& rng_per_rank,
                             const CheckpointHeader& header) {
  auto archive = checkpoint_archive(model, [&model](torch::serialize::OutputArchive& into) { model.save(into); },
                                    optimizer, progress, callbacks, rng_per_rank, header, path);
  save_checkpoint_archive(archive, path);
}

}  // namespace detail
}  // namespace trainloop
