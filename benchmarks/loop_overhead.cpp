// loop_overhead: how much slower is TrainLoop than the loop a competent libtorch user writes by
// hand? Both train the Fashion-MNIST CNN of examples/fashion_net.hpp for one pass over the same
// samples, interleaved repetition by repetition, and the median of the per-repetition
// throughput ratios is reported against the goal (overhead <= 3%).
//
//   loop_overhead --repetitions 5 --samples 6400 --batch-size 64 --device cpu --csv overhead.csv
//
// What makes the comparison fair:
// - the same work: both start from the same seeded weights, consume the global torch generator
//   identically (dropout), see the same batches in the same order and end with the same loss and
//   weights (printed; a loss mismatch is an error, since the ratio would then mean nothing);
// - the hand loop is the strict baseline: it slices contiguous batches out of the in-memory
//   tensors with narrow() (views, no copy), keeps the running loss on the device and reads it
//   once per pass — no per-example DataLoader + Stack, no per-batch synchronisation;
// - interleaving: the machine is shared and noisy, so every repetition runs both loops back to
//   back, alternating which goes first, and the median of the ratios is taken;
// - a short untimed warm-up of each loop first (allocator, lazy initialisation).
// The samples are a fixed random subset of the real training split, stored in that random order,
// so neither loop needs to shuffle.
//
// Exit status: 0 whatever the overhead (a benchmark reports, it does not assert); 1 on errors
// (bad flags, missing data, a loop that threw); 2 when the two loops did not do the same work.
//
// Profiling: `--only hand` / `--only trainloop` runs one loop per process; under
// `valgrind --tool=callgrind --instr-atstart=no` only its timed passes are counted (see README.md).

#include "fashion_net.hpp"
#include "op_profile.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <vector>

#include <time.h>

// Profiling hooks for --only: under `valgrind --tool=callgrind --instr-atstart=no` only the timed
// passes are instrumented, so loading the data and the warm-up run at full speed and the counts
// hold nothing but the loop. Outside valgrind the requests cost a few instructions.
#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define LOOP_OVERHEAD_PROFILE_BEGIN() CALLGRIND_START_INSTRUMENTATION
#define LOOP_OVERHEAD_PROFILE_END() CALLGRIND_STOP_INSTRUMENTATION
#else
#define LOOP_OVERHEAD_PROFILE_BEGIN() ((void)0)
#define LOOP_OVERHEAD_PROFILE_END() ((void)0)
#endif

namespace {

/// What both loops train on and with.
struct Workload {
  torch::Tensor inputs;   // (N, 1, 28, 28) float, on `device`
  torch::Tensor targets;  // (N) int64, on `device`
  int64_t batch_size = 64;
  double learning_rate = 1e-3;
  uint64_t seed = 0;
  torch::Device device = torch::kCPU;
  int64_t samples() const { return inputs.size(0); }
};

/// CPU seconds used by every thread of this process so far. Unlike wall time it does not grow
/// while other processes hold the cores (it still feels them through shared caches and SMT).
double process_cpu_seconds() {
  timespec now{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &now);
  return static_cast<double>(now.tv_sec) + 1e-9 * static_cast<double>(now.tv_nsec);
}

/// Wall and CPU time of one region.
class PassClock {
 public:
  PassClock() : wall_start_(std::chrono::steady_clock::now()), cpu_start_(process_cpu_seconds()) {}
  double wall_seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start_).count();
  }
  double cpu_seconds() const { return process_cpu_seconds() - cpu_start_; }

 private:
  std::chrono::steady_clock::time_point wall_start_;
  double cpu_start_;
};

/// One timed pass of one loop.
struct PassResult {
  double seconds = 0.0;      // wall time
  double cpu_seconds = 0.0;  // CPU time of the whole process (all threads)
  int64_t samples = 0;
  double mean_loss = 0.0;  // mean training loss per sample over the pass
  FashionNet model{nullptr};
  double samples_per_second() const { return seconds > 0 ? static_cast<double>(samples) / seconds : 0.0; }
  double samples_per_cpu_second() const {
    return cpu_seconds > 0 ? static_cast<double>(samples) / cpu_seconds : 0.0;
  }
};

/// The same initial weights for both loops: the model is built right after seeding.
FashionNet seeded_model(const Workload& w) {
  torch::manual_seed(w.seed);
  FashionNet net;
  net->to(w.device);
  return net;
}

/// The hand-written loop: contiguous batches by narrow(), the loss summed on the device and read
/// once at the end. `max_batches` < 0 means the whole pass.
PassResult hand_written_pass(const Workload& w, int64_t max_batches = -1) {
  FashionNet net = seeded_model(w);
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(w.learning_rate));
  const int64_t n = w.samples();
  const int64_t batches = (n + w.batch_size - 1) / w.batch_size;
  const int64_t run_batches = max_batches < 0 ? batches : std::min(batches, max_batches);

  torch::manual_seed(w.seed);  // TrainLoop reseeds at fit(): the same dropout masks
  const PassClock clock;
  net->train();
  auto loss_sum = torch::zeros({}, torch::TensorOptions().dtype(torch::kFloat64).device(w.device));
  int64_t seen = 0;
  for (int64_t b = 0; b < run_batches; ++b) {
    const int64_t first = b * w.batch_size;
    const int64_t count = std::min(w.batch_size, n - first);
    auto input = w.inputs.narrow(0, first, count);
    auto target = w.targets.narrow(0, first, count);
    optimizer.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(input), target);
    loss.backward();
    optimizer.step();
    loss_sum += loss.detach() * static_cast<double>(count);
    seen += count;
  }
  const double mean_loss = loss_sum.item<double>() / static_cast<double>(seen);
  return {clock.wall_seconds(), clock.cpu_seconds(), seen, mean_loss, net};
}

/// The same pass through TrainLoop: loss only, no metrics, no callbacks, no validation set, no
/// shuffling (the samples are already in random order). `max_batches` < 0 means the whole pass.
PassResult trainloop_pass(const Workload& w, const trainloop::data::AnyDataset<>& train, int64_t max_batches = -1) {
  FashionNet net = seeded_model(w);
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(w.learning_rate));
  trainloop::TrainLoop<FashionNet> loop(net, train, {}, optimizer, torch::nn::CrossEntropyLoss(),
                                        trainloop::TrainLoopOptions().batch_size(w.batch_size).shuffle(false).seed(w.seed)
                                            // the hand-written loop's layout: the same kernels, so the
                                            // difference is the loop's own work (bench_common.hpp)
                                            .memory_format(trainloop::MemoryFormat::contiguous),
                                        trainloop::gpu_mode::Single(w.device));
  const auto length = max_batches < 0 ? trainloop::FitLength::epochs(1) : trainloop::FitLength::iterations(max_batches);

  const PassClock clock;
  trainloop::History history = loop.fit(length);
  const double seconds = clock.wall_seconds();
  const double cpu_seconds = clock.cpu_seconds();
  return {seconds, cpu_seconds, history.last().samples, history.last().train_loss, net};
}

/// Largest absolute difference between corresponding parameters of two models.
double max_parameter_difference(const FashionNet& a, const FashionNet& b) {
  torch::NoGradGuard no_grad;
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  double largest = 0.0;
  for (size_t i = 0; i < pa.size(); ++i) {
    largest = std::max(largest, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return largest;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t m = values.size() / 2;
  return values.size() % 2 == 1 ? values[m] : 0.5 * (values[m - 1] + values[m]);
}

/// A fixed random subset of the training split, stored in that random order.
Workload load_workload(const std::string& data_dir, int64_t samples, int64_t batch_size, double learning_rate,
                       uint64_t seed, const torch::Device& device) {
  using trainloop::data::FashionMNIST;
  FashionMNIST train(FashionMNIST::Split::Train, data_dir);
  const int64_t available = train.inputs().size(0);
  TRAINLOOP_CHECK(samples >= 1 && samples <= available, "--samples is ", samples, "; expected 1 to ", available,
                  " (the size of the Fashion-MNIST training split)");
  torch::manual_seed(seed);
  const auto pick = torch::randperm(available, torch::kLong).narrow(0, 0, samples);
  Workload w;
  w.inputs = train.inputs().index_select(0, pick).contiguous().to(device);
  w.targets = train.targets().index_select(0, pick).contiguous().to(device);
  w.batch_size = batch_size;
  w.learning_rate = learning_rate;
  w.seed = seed;
  w.device = device;
  return w;
}

struct Row {
  int64_t repetition = 0;
  std::string first;
  PassResult hand;
  PassResult loop;
  double ratio = 0.0;      // trainloop / hand samples per wall second
  double cpu_ratio = 0.0;  // trainloop / hand samples per CPU second
  double parameter_difference = 0.0;
};

/// Opened before the repetitions, so a bad --csv path fails in a second, not after minutes.
std::ofstream open_csv(const std::string& path) {
  std::ofstream out(path);
  TRAINLOOP_CHECK(out.good(), "cannot open ", path, " for writing; expected a writable file path for --csv");
  return out;
}

void write_csv(std::ofstream& out, const std::string& path, const std::vector<Row>& rows) {
  out << "repetition,first,hand_samples_per_second,trainloop_samples_per_second,ratio,"
         "hand_samples_per_cpu_second,trainloop_samples_per_cpu_second,cpu_ratio,hand_loss,trainloop_loss,"
         "max_parameter_difference\n";
  out.precision(10);
  for (const auto& r : rows) {
    out << r.repetition << ',' << r.first << ',' << r.hand.samples_per_second() << ','
        << r.loop.samples_per_second() << ',' << r.ratio << ',' << r.hand.samples_per_cpu_second() << ','
        << r.loop.samples_per_cpu_second() << ',' << r.cpu_ratio << ',' << r.hand.mean_loss << ','
        << r.loop.mean_loss << ',' << r.parameter_difference << '\n';
  }
  TRAINLOOP_CHECK(out.good(), "writing ", path, " failed");
}

/// Runs only one of the loops, for a profiler (callgrind, perf) to compare their costs.
void run_one_loop(const std::string& which, const Workload& w, const trainloop::data::AnyDataset<>& train,
                  int64_t repetitions) {
  for (int64_t rep = 1; rep <= repetitions; ++rep) {
    LOOP_OVERHEAD_PROFILE_BEGIN();
    const PassResult r = which == "hand" ? hand_written_pass(w) : trainloop_pass(w, train);
    LOOP_OVERHEAD_PROFILE_END();
    std::printf("%s pass %lld: %.1f samples/s, %.1f samples per CPU second, loss %.6f\n", which.c_str(),
                static_cast<long long>(rep), r.samples_per_second(), r.samples_per_cpu_second(), r.mean_loss);
  }
}

/// One pass of each loop (or of `only`) under the op profiler: which ops each loop runs, how
/// often, and how much of its time is spent outside every op.
void profile_ops(const std::string& only, const Workload& w, const trainloop::data::AnyDataset<>& train,
                 size_t rows) {
  const int64_t steps = (w.samples() + w.batch_size - 1) / w.batch_size;
  for (const std::string which : {"hand", "trainloop"}) {
    if (!only.empty() && only != which) continue;
    bench::OpProfile profile;
    const PassResult r = which == "hand" ? hand_written_pass(w) : trainloop_pass(w, train);
    profile.stop();
    std::printf("\n%s loop, %lld steps, %.1f ms per step with the profiler on, loss %.6f:\n", which.c_str(),
                static_cast<long long>(steps), 1e3 * profile.wall_seconds() / static_cast<double>(steps), r.mean_loss);
    std::fflush(stdout);
    profile.print(std::cout, rows, steps);
    std::cout.flush();
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"TrainLoop vs a hand-written libtorch loop on the Fashion-MNIST CNN: throughput ratio"};
  int64_t repetitions = 5;
  int64_t samples = 6400;
  int64_t batch_size = 64;
  int64_t warmup_batches = 5;
  std::string device_name = "cpu";
  std::string data_dir = trainloop::data::FashionMNISTOptions().root().string();
  std::string csv_path;
  std::string only;
  size_t op_profile_rows = 0;
  double learning_rate = 1e-3;
  uint64_t seed = 0;
  app.add_option("--repetitions", repetitions, "timed passes of each loop, interleaved")->check(CLI::PositiveNumber);
  app.add_option("--samples", samples, "training samples per pass, taken from the real training split")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch")->check(CLI::PositiveNumber);
  app.add_option("--warmup-batches", warmup_batches, "untimed batches of each loop before the repetitions")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", device_name, "cpu or cuda:N");
  app.add_option("--data", data_dir, "directory with the Fashion-MNIST *-idx?-ubyte.gz files");
  app.add_option("--lr", learning_rate, "Adam learning rate");
  app.add_option("--seed", seed, "seed for the sample subset, the weights and dropout");
  app.add_option("--csv", csv_path, "also write the per-repetition results to this CSV file");
  app.add_option("--only", only, "run only this loop (for profiling): hand or trainloop")
      ->check(CLI::IsMember({"hand", "trainloop"}));
  app.add_option("--op-profile", op_profile_rows,
                 "instead of timing: one pass of each loop under libtorch's op observers, printing this many "
                 "ops by self time and the time outside every op");
  CLI11_PARSE(app, argc, argv);

  try {
    std::ofstream csv;
    if (!csv_path.empty()) csv = open_csv(csv_path);
    const torch::Device device(device_name);
    const Workload w = load_workload(data_dir, samples, batch_size, learning_rate, seed, device);
    // Built once, outside every timed region: it shares w's tensors (no copy).
    const trainloop::data::AnyDataset<> train = trainloop::data::TensorDataset(w.inputs, w.targets);

    std::printf("loop_overhead: FashionNet on %lld Fashion-MNIST training samples, batch size %lld, Adam lr %g, "
                "device %s, %d torch threads, %lld repetitions (+%lld warm-up batches)\n",
                static_cast<long long>(w.samples()), static_cast<long long>(batch_size), learning_rate,
                device.str().c_str(), torch::get_num_threads(), static_cast<long long>(repetitions),
                static_cast<long long>(warmup_batches));
    if (warmup_batches > 0) {
      if (only != "trainloop") hand_written_pass(w, warmup_batches);
      if (only != "hand") trainloop_pass(w, train, warmup_batches);
    }
    if (op_profile_rows > 0) {
      profile_ops(only, w, train, op_profile_rows);
      return 0;
    }
    if (!only.empty()) {
      run_one_loop(only, w, train, repetitions);
      return 0;
    }

    std::printf("\n%4s  %-9s  %12s  %12s  %7s  %9s  %10s  %10s  %8s\n", "rep", "first", "hand smp/s", "loop smp/s",
                "ratio", "cpu ratio", "hand loss", "loop loss", "max |dw|");
    std::vector<Row> rows;
    for (int64_t rep = 1; rep <= repetitions; ++rep) {
      Row row;
      row.repetition = rep;
      // Alternate the order so slow drift (thermal, other jobs) does not favour one loop.
      if (rep % 2 == 1) {
        row.first = "hand";
        row.hand = hand_written_pass(w);
        row.loop = trainloop_pass(w, train);
      } else {
        row.first = "trainloop";
        row.loop = trainloop_pass(w, train);
        row.hand = hand_written_pass(w);
      }
      row.ratio = row.loop.samples_per_second() / row.hand.samples_per_second();
      row.cpu_ratio = row.loop.samples_per_cpu_second() / row.hand.samples_per_cpu_second();
      row.parameter_difference = max_parameter_difference(row.hand.model, row.loop.model);
      std::printf("%4lld  %-9s  %12.1f  %12.1f  %7.4f  %9.4f  %10.6f  %10.6f  %8.2g\n", static_cast<long long>(rep),
                  row.first.c_str(), row.hand.samples_per_second(), row.loop.samples_per_second(), row.ratio,
                  row.cpu_ratio, row.hand.mean_loss, row.loop.mean_loss, row.parameter_difference);
      std::fflush(stdout);
      rows.push_back(std::move(row));
    }

    std::vector<double> ratios;
    std::vector<double> cpu_ratios;
    std::vector<double> hand_rates;
    std::vector<double> loop_rates;
    bool same_work = true;
    for (const auto& r : rows) {
      ratios.push_back(r.ratio);
      cpu_ratios.push_back(r.cpu_ratio);
      hand_rates.push_back(r.hand.samples_per_second());
      loop_rates.push_back(r.loop.samples_per_second());
      same_work = same_work && r.hand.samples == r.loop.samples &&
                  std::abs(r.hand.mean_loss - r.loop.mean_loss) <= 1e-4 * std::max(1.0, std::abs(r.hand.mean_loss));
    }
    const double median_ratio = median(ratios);
    const double median_cpu_ratio = median(cpu_ratios);
    std::printf("\nmedian samples/s: hand %.1f, trainloop %.1f\n", median(hand_rates), median(loop_rates));
    std::printf("median ratio trainloop/hand: %.4f (min %.4f, max %.4f)\n", median_ratio,
                *std::min_element(ratios.begin(), ratios.end()), *std::max_element(ratios.begin(), ratios.end()));
    std::printf("median ratio by CPU time:    %.4f (min %.4f, max %.4f; time spent waiting for a core excluded)\n",
                median_cpu_ratio, *std::min_element(cpu_ratios.begin(), cpu_ratios.end()),
                *std::max_element(cpu_ratios.begin(), cpu_ratios.end()));
    std::printf("final loss: hand %.6f, trainloop %.6f (last repetition; max |dw| = largest weight difference)\n",
                rows.back().hand.mean_loss, rows.back().loop.mean_loss);
    std::printf("overhead %.1f%% (goal <= 3%%); by CPU time %.1f%%\n", (1.0 - median_ratio) * 100.0,
                (1.0 - median_cpu_ratio) * 100.0);

    if (!csv_path.empty()) write_csv(csv, csv_path, rows);
    if (!same_work) {
      std::fprintf(stderr,
                   "error: the two loops did not do the same work (different sample counts or final losses); "
                   "the ratio above is not a valid comparison\n");
      return 2;
    }
    return 0;
  } catch (const c10::Error& e) {  // a bad --device, or libtorch failing inside a loop
    std::cerr << "loop_overhead: " << e.what_without_backtrace() << '\n';
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "loop_overhead: " << e.what() << '\n';
    return 1;
  }
}
