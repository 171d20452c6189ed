// A program whose rank 1 hangs (or calls a different collective) in step 3, driven by
// test_stall_watchdog: fit() re-executes it once per rank (or torchrun / mpirun start its ranks).
//
//   stall_worker <scenario> <out-dir>
//
// Scenarios — a stall on rank 1: sleep_in_forward, blocked_callback, spinning_loader, frozen
// (rank 1 stops itself with SIGSTOP: its watchdog stops too, rank 0 names it); a desync
// on rank 1: skipped_collective, other_shape; no stall: slow_progress (rank 1 0.4 s per batch),
// slow_first_step (rank 1's first forward 5 s), long_checkpoint_write (rank 0 writes for 5 s),
// main_process_alone (a main-process-only callback works 10 s on rank 0 while rank 1 waits);
// report_only: rank 1 sleeps 5 s in forward once with TRAINLOOP_STALL_ACTION=report.
// The stall limit comes from TRAINLOOP_STALL_LIMIT (the test sets 2 s); the collective timeout is
// 60 s, far beyond what any case may take. In the launching process it writes <out-dir>/result.txt:
// "OK <seconds>" or "RANK_FAILED rank=<r> type=<type> seconds=<s>" and the message.

#include "ddp_test_model.hpp"

#include <atomic>
#include <csignal>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>

namespace tl = trainloop;

std::string scenario;

int own_rank() {
  for (const char* name : {"TRAINLOOP_RANK", "RANK", "OMPI_COMM_WORLD_RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value);
  }
  return -1;
}

/// Rank 1 in the step the scenarios misbehave in (after two steps: past the warm-up grace).
bool rank1_at_step3() { return own_rank() == 1 && tl::progress::progress_beacon().global_step() == 3; }

// The user's own functions a stall report must name (addr2line reads them from the symbol table).
namespace user_code {

[[gnu::noinline]] void sleep_inside_forward(double seconds) {
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
}

[[gnu::noinline]] void wait_for_a_lock_nobody_releases() {
  static std::mutex mutex;
  static std::condition_variable never;
  std::unique_lock<std::mutex> lock(mutex);
  never.wait(lock, [] { return false; });
}

[[gnu::noinline]] void spin_reading_a_file_that_never_arrives() {
  static std::atomic<bool> arrived{false};
  while (!arrived.load()) {
  }
}

}  // namespace user_code

struct SleepyMlpImpl : MlpImpl {
  torch::Tensor forward(torch::Tensor x) {
    static bool first_forward = true;
    if (scenario == "sleep_in_forward" && rank1_at_step3()) user_code::sleep_inside_forward(60);
    if (scenario == "report_only" && rank1_at_step3() && std::exchange(report_sleep_pending, false)) {
      user_code::sleep_inside_forward(5);
    }
    if (scenario == "slow_first_step" && own_rank() == 1 && std::exchange(first_forward, false)) {
      user_code::sleep_inside_forward(5);
    }
    return MlpImpl::forward(x);
  }
  bool report_sleep_pending = true;
};
TORCH_MODULE(SleepyMlp);

/// The training data; its batches spin forever on rank 1 from step 3 on (spinning_loader).
struct MaybeSpinningDataset : tl::data::TensorDataset {
  using TensorDataset::TensorDataset;
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    if (scenario == "spinning_loader" && rank1_at_step3()) user_code::spin_reading_a_file_that_never_arrives();
    return TensorDataset::get_batch(indices);
  }
};

/// What the scenarios do from callbacks.
struct Misbehave : tl::Callback {
  void on_batch_end(tl::TrainState&) override {
    if (scenario == "blocked_callback" && rank1_at_step3()) user_code::wait_for_a_lock_nobody_releases();
    if (scenario == "frozen" && rank1_at_step3()) std::raise(SIGSTOP);
    if (scenario == "slow_progress" && own_rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }
  void on_step_end(tl::TrainState& state) override {
    auto& group = tl::distributed::session_process_group();
    if (scenario == "skipped_collective") {
      // Every step every rank sums a number, except rank 1 in step 3.
      if (!(own_rank() == 1 && state.global_step == 3)) group.all_reduce_sum(torch::ones({1}, torch::kFloat64));
    }
    if (scenario == "other_shape" && state.global_step == 3) {
      group.all_reduce_sum(torch::ones({own_rank() == 1 ? 3 : 2}));
    }
    if (scenario == "long_checkpoint_write" && state.global_step == 3) state.save_checkpoint(checkpoint);
  }
  std::string checkpoint;
};

/// Works 10 s on the main process only (a plot, a file) in step 3: rank 1 waits in the next collective.
struct SlowOnMainProcess : tl::Callback {
  bool main_process_only() const override { return true; }
  void on_step_end(tl::TrainState& state) override {
    if (scenario == "main_process_alone" && state.global_step == 3) std::this_thread::sleep_for(std::chrono::seconds(10));
  }
};

/// Its state takes 5 s to write on rank 0 (a slow file system), inside the checkpoint's write.
struct SlowToSave : tl::Callback {
  void save_state(torch::serialize::OutputArchive& archive) const override {
    if (scenario == "long_checkpoint_write" && own_rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(5));
    archive.write("slow", c10::IValue(int64_t{1}));
  }
  void load_state(torch::serialize::InputArchive&) override {}
};

int main(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << "usage: stall_worker <scenario> <out-dir>\n";
    return 2;
  }
  scenario = argv[1];
  const std::string dir = argv[2];
  torch::manual_seed(5);
  SleepyMlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05));
  const auto data = make_data(8 * 12, 1);  // 12 steps of 2 ranks x batch 4
  MaybeSpinningDataset train(data.inputs(), data.targets(), 3);
  auto options = tl::TrainLoopOptions().batch_size(4).shuffle(false);
  if (scenario == "spinning_loader") options.num_workers(1);
  auto mode = tl::gpu_mode::DistributedDataParallel().procs_per_node(2).device_type(torch::kCPU).timeout(std::chrono::seconds(60));
  tl::TrainLoop<SleepyMlp, tl::gpu_mode::DistributedDataParallel> loop(net, train, {}, optimizer,
                                                                       torch::nn::CrossEntropyLoss(), options, mode);
  auto misbehave = std::make_shared<Misbehave>();
  misbehave->checkpoint = dir + "/step3.ckpt";
  const auto started = std::chrono::steady_clock::now();
  auto seconds = [&] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count(); };
  std::ofstream result;
  const bool launching = std::getenv("TRAINLOOP_RANK") == nullptr && std::getenv("RANK") == nullptr &&
                         std::getenv("OMPI_COMM_WORLD_RANK") == nullptr;
  try {
    loop.fit(1, {misbehave, std::make_shared<SlowToSave>(), std::make_shared<SlowOnMainProcess>()});
    if (launching || own_rank() == 0) std::ofstream(dir + "/result.txt") << "OK " << seconds() << "\n";
  } catch (const tl::Error& error) {
    // A rank's StallError or DesyncError arrives as that class with the RankFailedError nested.
    tl::RankFailedError::Details details;
    try {
      std::rethrow_if_nested(error);
      if (const auto* failed = dynamic_cast<const tl::RankFailedError*>(&error)) details = failed->details();
    } catch (const tl::RankFailedError& nested) {
      details = nested.details();
    } catch (...) {
    }
    std::ofstream(dir + "/result.txt") << "RANK_FAILED rank=" << details.rank << " type=" << details.error_type
                                       << " caught=" << tl::detail::error_type_name(error) << " seconds=" << seconds()
                                       << "\n" << error.what() << "\n";
    return 3;
  }
  return 0;
}
