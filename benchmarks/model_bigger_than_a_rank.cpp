// model_bigger_than_a_rank: one rank of a job started by hand (torchrun's variables: RANK,
// WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), so that no launching
// process holds the model; benchmarks/run_memory_limit.sh starts the ranks, puts the whole job
// under one cgroup memory limit and prints the tables (benchmarks/README.md, "A model bigger than
// one rank").
//
//   model_bigger_than_a_rank --phase train  --level full --checkpoints DIR --record FILE   (every rank)
//   model_bigger_than_a_rank --phase resume --level full --checkpoints DIR --record FILE   (any world size)
//   model_bigger_than_a_rank --phase read-weights --checkpoints DIR --record FILE          (one process)
//   model_bigger_than_a_rank --phase read-loop    --checkpoints DIR --record FILE          (one process)
//
// The model is benchmarks/deep_linear.hpp's DeepLinear (--layers 6 --width 4096: 100.7 M
// parameters, 7 units, 64 MiB per hidden layer in fp32), trained with Adam. Levels: none (plain
// DDP: rank 0 writes one libtorch archive holding everything), optimizer (ZeRO-1, DDP's zero()),
// gradients and full (gpu_mode::FullyShardedDataParallel; full with whole_model_after_fit(false)).
// Every sharded level writes per-rank checkpoints (torch.distributed.checkpoint's layout).
//
// Phases and what each rank records (one line of key=value per rank appended to --record):
// - train: the model is built, fit() trains one epoch (--steps optimizer steps per rank), validates
//   on a held-out set and ModelCheckpoint writes a checkpoint at the epoch's end; then the program
//   ends (the ranks exit: the "kill" after the checkpoint).
// - resume: the loop is prepared (loop.barrier(): process group, sharding), then
//   loop.load_checkpoint(newest checkpoint in --checkpoints) (timed), then one more epoch with
//   validation, on any number of ranks; with --resume-in-fit, fit(1, ..., Resume::from(newest))
//   instead (the load is then part of the setup phase).
// - read-weights: one process, no distribution: trainloop::interop::load_dcp_weights into a
//   whole DeepLinear (weights only, the reader of single mode for a per-rank checkpoint).
// - read-loop: one process, gpu_mode::Single: TrainLoop::load_checkpoint (weights and the whole
//   Adam state).
//
// Peaks per phase: /proc/self/status's VmHWM (the peak resident set), reset to the current
// resident set at each phase boundary by writing "5" to /proc/self/clear_refs; ru_maxrss at exit
// with the peaks before each reset is the peak over the whole run (maxrss). Phase boundaries are callback events: setup = program start to
// on_fit_begin (building the model, the datasets, the optimizer, the loop and, for sharded levels,
// cutting the model into this rank's chunks); steps = on_fit_begin to the last on_step_end (the
// maximum over the steps); evaluation = the last on_step_end to on_validation_end; checkpoint =
// our on_epoch_end (which runs before ModelCheckpoint's: it runs after the others) to on_fit_end.
// The process's own footprint ("process") is the resident set after the datasets were made and
// before the model was built (libtorch, the program, the data); "model built" is the resident set
// once the whole model and the loop exist, before fit().

#include <trainloop/trainloop.hpp>
#include <trainloop/interop/dcp_weights.hpp>

#include "deep_linear.hpp"

#include <CLI/CLI.hpp>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

/// A field of /proc/self/status in MiB (kB there).
double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::strtod(line.c_str() + field.size() + 1, nullptr) / 1024.0;
  }
  return -1.0;
}
double resident_mib() { return status_mib("VmRSS"); }
/// The peak resident set since the last reset_peak() (or the process's start).
double peak_mib() { return status_mib("VmHWM"); }
/// The peak before the latest reset_peak(), over the whole run.
double peak_before_resets = 0.0;
/// Sets the peak to the resident set now (Linux >= 4.0). The kernel's one high-water mark backs
/// both VmHWM and getrusage's ru_maxrss, so the run's peak is kept here.
void reset_peak() {
  peak_before_resets = std::max(peak_before_resets, peak_mib());
  std::ofstream("/proc/self/clear_refs") << "5";
}
/// The peak resident set over the whole run: ru_maxrss, or the highest peak before a reset.
double maxrss_mib() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  return std::max(peak_before_resets, static_cast<double>(usage.ru_maxrss) / 1024.0);  // KiB on Linux
}

/// Bytes of a file, or of every file under a directory.
long long size_of(const fs::path& path) {
  if (fs::is_regular_file(path)) return static_cast<long long>(fs::file_size(path));
  long long total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(path)) {
    if (entry.is_regular_file()) total += static_cast<long long>(entry.file_size());
  }
  return total;
}

/// The newest periodic checkpoint (file or directory) in `directory`.
fs::path newest_checkpoint(const fs::path& directory) {
  std::vector<fs::path> found;
  for (const auto& entry : fs::directory_iterator(directory)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("epoch=", 0) == 0 && name.size() > 5 && name.substr(name.size() - 5) == ".ckpt") found.push_back(entry.path());
  }
  if (found.empty()) throw std::runtime_error("no checkpoint epoch=*.ckpt in " + directory.string());
  std::sort(found.begin(), found.end());
  return found.back();
}

/// One line of key=value pairs.
struct Record {
  std::ostringstream text;
  template <class T>
  Record& add(const std::string& key, const T& value) {
    text << key << '=' << value << ' ';
    return *this;
  }
  Record& mib(const std::string& key, double value) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.0f", value);
    return add(key, buffer);
  }
  Record& secs(const std::string& key, double value) {
    char buffer[32];
    std::snprintf(buffer, sizeof buffer, "%.3f", value);
    return add(key, buffer);
  }
};

/// Peaks per phase (file comment), kept by every rank.
struct PhasePeaks : tl::Callback {
  explicit PhasePeaks(Record& record) : record(record) {}
  bool main_process_only() const override { return false; }
  void on_fit_begin(tl::TrainState&) override {
    record.mib("setup_peak", peak_mib()).mib("fit_begin_rss", resident_mib());
    reset_peak();
    step_start = Clock::now();
  }
  void on_step_end(tl::TrainState&) override {
    steps_peak = std::max(steps_peak, peak_mib());
    step_seconds.push_back(seconds_since(step_start));
    reset_peak();
    step_start = Clock::now();
  }
  void on_validation_end(tl::TrainState&, const tl::EvalResult&) override {
    eval_peak = peak_mib();
    eval_seconds = seconds_since(step_start);
    reset_peak();
  }
  void on_epoch_end(tl::TrainState&, const tl::EpochRecord&) override {
    between_peak = peak_mib();  // validation's end to the epoch's end: nothing expected
    reset_peak();
    checkpoint_start = Clock::now();  // ModelCheckpoint's on_epoch_end runs after this one
  }
  void on_fit_end(tl::TrainState&, const tl::History&) override {
    checkpoint_seconds = seconds_since(checkpoint_start);
    checkpoint_peak = peak_mib();
    reset_peak();
  }
  void write(bool checkpointed) {
    std::vector<double> sorted = step_seconds;
    std::sort(sorted.begin(), sorted.end());
    record.mib("steps_peak", steps_peak).mib("eval_peak", std::max(eval_peak, between_peak));
    if (!sorted.empty()) record.secs("step_s_median", sorted[sorted.size() / 2]).add("steps", sorted.size());
    record.secs("eval_s", eval_seconds);
    if (checkpointed) record.mib("ckpt_write_peak", checkpoint_peak).secs("ckpt_write_s", checkpoint_seconds);
  }
  Record& record;
  Clock::time_point step_start, checkpoint_start;
  std::vector<double> step_seconds;
  double steps_peak = 0.0, eval_peak = 0.0, between_peak = 0.0, checkpoint_peak = 0.0, eval_seconds = 0.0,
         checkpoint_seconds = 0.0;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A ~100 M-parameter MLP (Adam) trained, validated, checkpointed, resumed and read, one rank of a "
               "job started by hand, peak resident set per phase"};
  std::string phase = "train", level = "full", checkpoints, record_path;
  int64_t layers = 6, width = 4096, batch_size = 8, steps = 3, val_samples = 48;
  app.add_option("--phase", phase)->check(CLI::IsMember({"train", "resume", "read-weights", "read-loop"}));
  app.add_option("--level", level, "sharding: none (plain DDP), optimizer (ZeRO-1), gradients, full")
      ->check(CLI::IsMember({"none", "optimizer", "gradients", "full"}));
  app.add_option("--checkpoints", checkpoints, "ModelCheckpoint's directory (train writes, the others read)")->required();
  app.add_option("--record", record_path, "file to which each rank appends its line of key=value")->required();
  app.add_option("--layers", layers, "hidden width x width layers");
  app.add_option("--width", width, "layer width");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  app.add_option("--steps", steps, "optimizer steps per epoch at 2 ranks (the dataset: 2 x batch x steps samples)");
  app.add_option("--val-samples", val_samples, "validation samples");
  bool resume_in_fit = false;
  app.add_flag("--resume-in-fit", resume_in_fit,
               "resume: fit(1, callbacks, Resume::from(checkpoint)) (the loop loads it as the fit starts) instead of "
               "load_checkpoint() before fit()");
  CLI11_PARSE(app, argc, argv);
  Record record;
  const auto program_start = Clock::now();
  try {
    const auto env = tl::distributed::detect_rank_env();
    const int rank = env ? env->rank : 0;
    const int world = env ? env->world_size : 1;
    record.add("phase", phase).add("level", level).add("rank", rank).add("world", world);
    torch::set_num_threads(1);  // 2 cores shared by the ranks (as a launcher would set per rank)

    const int64_t samples = 2 * batch_size * steps;
    auto x = torch::randn({samples, width}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
    auto vx = torch::randn({val_samples, width}, at::detail::createCPUGenerator(3));
    auto vy = torch::randint(0, 10, {val_samples}, at::detail::createCPUGenerator(4));
    tl::data::TensorDataset train(x, y, 10), validation(vx, vy, 10);
    record.mib("process_rss", resident_mib());  // before the model: libtorch, the program, the data

    torch::manual_seed(0);
    DeepLinear net(layers, width, 10);
    int64_t parameters = 0;
    for (const auto& p : net->parameters()) parameters += p.numel();
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-4));
    record.add("parameters", parameters);

    if (phase == "read-weights") {
      const fs::path path = newest_checkpoint(checkpoints);
      record.mib("model_rss", resident_mib());
      reset_peak();
      const auto start = Clock::now();
      tl::interop::load_dcp_weights(*net, path);
      record.secs("read_s", seconds_since(start)).mib("read_peak", peak_mib()).mib("maxrss", maxrss_mib());
      record.add("ckpt_bytes", size_of(path));
      std::ofstream(record_path, std::ios::app) << record.text.str() << '\n';
      return 0;
    }

    tl::gpu_mode::Any mode = tl::gpu_mode::Single();
    if (phase != "read-loop") {
      auto ddp = tl::gpu_mode::DistributedDataParallel()
                     .procs_per_node(world)
                     .device_type(torch::kCPU)
                     .timeout(std::chrono::seconds(300))
                     .zero(level == "optimizer");
      mode = ddp;
      if (level == "gradients" || level == "full") {
        mode = tl::gpu_mode::FullyShardedDataParallel()
                   .processes_like(ddp)
                   .sharding(tl::distributed::sharding_named(level))
                   .whole_model_after_fit(false);
      }
    }
    tl::TrainLoop<DeepLinear, tl::gpu_mode::Any> loop(net, train, validation, optimizer, torch::nn::CrossEntropyLoss(),
                                                      tl::TrainLoopOptions().batch_size(batch_size).progress(false), mode);
    record.mib("model_rss", resident_mib());  // the whole model, its optimizer (empty state) and the loop

    if (phase == "read-loop") {
      const fs::path path = newest_checkpoint(checkpoints);
      reset_peak();
      const auto start = Clock::now();
      loop.load_checkpoint(path);
      record.secs("read_s", seconds_since(start)).mib("read_peak", peak_mib()).mib("maxrss", maxrss_mib());
      record.add("ckpt_bytes", size_of(path));
      std::ofstream(record_path, std::ios::app) << record.text.str() << '\n';
      return 0;
    }

    auto peaks = std::make_shared<PhasePeaks>(record);
    if (phase == "train") {
      // Training waits for the write: a job at its memory limit has no room for the host buffers of
      // a checkpoint written behind training (one more share of the state per rank: docs/checkpoints-and-resume.md).
      auto checkpoint = std::make_shared<tl::ModelCheckpoint>(
          tl::ModelCheckpointOptions(checkpoints).every_n_epochs(1).keep_last(1).in_background(false));
      auto history = loop.fit(1, {peaks, checkpoint});
      peaks->write(true);
      const fs::path path = newest_checkpoint(checkpoints);
      record.add("ckpt", path.filename().string()).add("ckpt_bytes", size_of(path));
      record.add("optimizer_state_bytes", history.last().optimizer_state_bytes);
      record.add("train_loss", history.last().train_loss);
      if (history.last().validation) record.add("val_loss", history.last().validation->loss);
    } else if (resume_in_fit) {  // resume: the fit loads the checkpoint (its setup phase holds the load)
      const fs::path path = newest_checkpoint(checkpoints);
      record.add("resume", "in-fit");
      auto history = loop.fit(1, {peaks}, tl::Resume::from(path.string()));
      peaks->write(false);
      record.add("epochs", history.epochs.size());
      if (history.last().validation) record.add("val_loss", history.last().validation->loss);
    } else {  // resume
      const fs::path path = newest_checkpoint(checkpoints);
      loop.barrier();  // the process group and (sharded levels) this rank's chunks
      record.mib("prepared_peak", peak_mib()).mib("prepared_rss", resident_mib());
      reset_peak();
      const auto start = Clock::now();
      loop.load_checkpoint(path);
      record.secs("ckpt_load_s", seconds_since(start)).mib("ckpt_load_peak", peak_mib());
      reset_peak();
      auto history = loop.fit(1, {peaks});
      peaks->write(false);
      record.add("epochs", history.epochs.size());
      if (history.last().validation) record.add("val_loss", history.last().validation->loss);
    }
    record.mib("maxrss", maxrss_mib()).secs("total_s", seconds_since(program_start));
    std::ofstream(record_path, std::ios::app) << record.text.str() << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR (" << phase << ", " << level << "): " << e.what() << '\n';
    return 1;
  }
}
