// compare_modes: one workload trained by a hand-written libtorch loop and by TrainLoop in every
// gpu_mode, repetition by repetition, and one table: samples/s, step time median and p95, and the
// throughput ratio to the hand-written loop (also written as CSV).
//
//   compare_modes --workload cnn --repetitions 3 --samples 6400 --batch-size 64 --device cpu --replicas 2 --procs 2 --modes hand,single,dp,ddp --csv compare_modes.csv
//
// Workloads:
// - cnn (default): the Fashion-MNIST CNN of examples/fashion_net.hpp on a fixed random subset of
//   the real training split, Adam(lr 1e-3) — compute dominates;
// - mlp: a wide MLP 784 -> 1024 -> 1024 -> 10 on synthetic N(0,1) data, SGD(lr 0.01, momentum
//   0.9) — 7.5 MB of gradients per step, so gradient communication dominates under DDP;
//   --mlp-width / --mlp-layers make it matmul-bound (e.g. 4096 x 4 on a GPU, against
//   benchmarks/mlp_pytorch.py running the same loop in Python).
// Every run is one pass (one epoch) over the same samples, from the same seeded weights, without
// shuffling (the samples are stored in random order) and without validation or metrics.
//
// What a "step" is (one optimizer step):
// - hand, single: one batch of --batch-size samples;
// - dp: one batch of --batch-size samples, split across --replicas replicas in this process;
// - ddp: one batch of --batch-size samples on EACH of --procs ranks, so a step trains
//   procs x batch samples and a pass has 1/procs as many steps.
// samples/s always counts every sample trained, over all ranks.
//
// How it is measured:
// - hand: the loop of bench_common.hpp, each step timed from slicing the batch to the end of the
//   optimizer step; samples/s = samples / wall time of the pass;
// - TrainLoop modes: a callback takes a timestamp at on_epoch_begin and at every on_step_end (step
//   time = difference of consecutive timestamps, so it includes batch assembly); samples/s is
//   History::samples_per_second (the training part of the epoch, all ranks);
// - ddp: fit() re-executes this program once per rank; the ranks re-run main() with the same
//   argv, skip everything but their DDP fit() and end there. Rank 0's step timer writes its step
//   times to `<csv>.ddp_steps`, which the launching process reads after fit() returns. A DDP run
//   starts fresh processes, so it has no warm-up; "fit s" (wall time of the whole fit() call in
//   this process) shows what the launch itself costs.
// - interleaving: every repetition runs every mode once, the order rotated by one each repetition,
//   so slow drift on a shared machine does not favour one mode; hand, single and dp get a short
//   untimed warm-up first (allocator, lazy initialisation).
// Table columns: samples/s is the median over repetitions; step median and p95 are over the steps
// of all repetitions pooled; "vs hand" is the median over repetitions of (mode samples/s) /
// (hand samples/s of the same repetition).
//
// Threads: hand and single use libtorch's default intra-op count (--threads overrides it); dp
// gives each replica's worker cores / replicas threads, and each ddp rank gets cores / procs
// (OMP_NUM_THREADS, when set, wins everywhere). So on a CPU, dp and ddp may use more cores than
// hand and single do: the header line prints the count hand and single ran with.
//
// Exit status: 0 whatever the numbers; 1 on errors (bad flags, missing data, a run that threw).

#include "bench_common.hpp"
#include "fashion_net.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

/// Everything the command line chooses.
struct Config {
  std::string workload = "cnn";
  int64_t repetitions = 3;
  int64_t samples = 6400;
  int64_t batch_size = 64;
  int64_t warmup_batches = 5;
  std::string device_name = "cpu";
  int replicas = 2;
  int procs = 2;
  int threads = 0;  // intra-op threads of hand and single; 0 = libtorch's default
  std::string csv_path = "compare_modes.csv";
  std::vector<std::string> modes = {"hand", "single", "dp", "ddp"};
  std::string data_dir = trainloop::data::FashionMNISTOptions().root().string();
  uint64_t seed = 0;
  double peak_gflops = 0.0;  // 0: a large sgemm on the CPU's cores measures it (CPU runs only)
  // TrainLoop's modes only (the hand loop stays fp32 contiguous: its ratio means something only
  // at these defaults); to compare with Python in the same settings (cnn_pytorch.py).
  std::string precision = "fp32";
  std::string memory_format = "contiguous";
  torch::Device device() const { return torch::Device(device_name); }
  /// Where rank 0 of a DDP run leaves its step times for the launching process.
  std::string ddp_steps_path() const { return csv_path + ".ddp_steps"; }
};

/// One timed run of one mode.
struct Run {
  double samples_per_second = 0.0;
  double fit_seconds = 0.0;  // wall time of the whole call in this process (DDP: launch included)
  int64_t samples = 0;
  int64_t steps = 0;
  double loss = 0.0;
  std::vector<double> step_seconds;
  std::string threads;  // the thread configuration the run computed with
};

/// Records the wall time of every optimizer step; optionally writes them to a file at the end
/// (how rank 0 of a DDP run hands them to the launching process).
class StepTimer : public trainloop::Callback {
 public:
  StepTimer(torch::Device device, std::string dump_path) : device_(device), dump_path_(std::move(dump_path)) {}
  bool main_process_only() const override { return true; }  // rank 0's steps; it may write a file
  void on_epoch_begin(trainloop::TrainState&) override { last_ = Clock::now(); }
  void on_step_end(trainloop::TrainState&) override {
    bench::wait_for_device(device_);
    const auto now = Clock::now();
    step_seconds_.push_back(std::chrono::duration<double>(now - last_).count());
    last_ = now;
  }
  void on_fit_end(trainloop::TrainState&, const trainloop::History&) override {
    if (dump_path_.empty()) return;
    const std::string temporary = dump_path_ + ".tmp";
    {
      std::ofstream out(temporary);
      out.precision(17);
      for (double s : step_seconds_) out << s << '\n';
      TRAINLOOP_CHECK(out.good(), "cannot write the step times to ", temporary, "; expected a writable --csv path");
    }
    std::filesystem::rename(temporary, dump_path_);
  }
  const std::vector<double>& step_seconds() const { return step_seconds_; }

 private:
  torch::Device device_;
  std::string dump_path_;
  Clock::time_point last_ = Clock::now();
  std::vector<double> step_seconds_;
};

std::vector<double> read_step_file(const std::string& path) {
  std::ifstream in(path);
  TRAINLOOP_CHECK(in.good(), "rank 0 of the DDP run left no step times at ", path,
                  "; expected the file its step timer writes at the end of fit()");
  std::vector<double> values;
  for (double s; in >> s;) values.push_back(s);
  in.close();
  std::filesystem::remove(path);
  return values;
}

/// FLOPs of one training step per sample: 6 x the forward pass's multiply-adds.
double flops_per_sample(const Config& c) {
  return c.workload == "mlp" ? bench::mlp_shape().training_flops_per_sample() : bench::fashion_net_training_flops();
}

/// The same initial weights in every run: the model is built right after seeding.
template <class Model>
Model seeded_model(const Config& c, const torch::Device& device) {
  torch::manual_seed(c.seed);
  Model net;
  net->to(device);
  return net;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& c, std::vector<torch::Tensor> parameters) {
  if (c.workload == "mlp")
    return std::make_unique<torch::optim::SGD>(std::move(parameters), torch::optim::SGDOptions(0.01).momentum(0.9));
  return std::make_unique<torch::optim::Adam>(std::move(parameters), torch::optim::AdamOptions(1e-3));
}

trainloop::gpu_mode::Any make_mode(const std::string& name, const Config& c) {
  namespace gm = trainloop::gpu_mode;
  const torch::Device device = c.device();
  if (name == "single") return gm::Single(device);
  if (name == "dp" || name == "dp-unordered") {
    // dp-unordered: every replica's forward at once, random layers or not (reproducible(false)),
    // to measure what ordering the forwards of a model with dropout costs.
    if (device.is_cpu()) return gm::DataParallel::cpu_replicas(c.replicas).reproducible(name == "dp");
    std::vector<torch::Device> devices;
    for (int i = 0; i < c.replicas; ++i) devices.emplace_back(torch::kCUDA, static_cast<torch::DeviceIndex>(i));
    return gm::DataParallel(devices).reproducible(name == "dp");
  }
  TRAINLOOP_CHECK(name == "ddp", "unknown mode '", name, "'; expected hand, single, dp, dp-unordered or ddp");
  return gm::DistributedDataParallel().procs_per_node(c.procs).device_type(device.type());
}

template <class Model>
Run hand_run(const Config& c, const bench::TensorPair& data, int64_t max_batches = -1) {
  Model net = seeded_model<Model>(c, c.device());
  auto optimizer = make_optimizer(c, net->parameters());
  torch::manual_seed(c.seed);  // TrainLoop reseeds at fit(): the same dropout masks as single
  const auto start = Clock::now();
  bench::HandPass pass = bench::hand_written_pass(net, *optimizer, data, c.batch_size, max_batches);
  Run run;
  run.fit_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  run.samples_per_second = pass.samples_per_second();
  run.samples = pass.samples;
  run.steps = static_cast<int64_t>(pass.step_seconds.size());
  run.loss = pass.mean_loss;
  run.step_seconds = std::move(pass.step_seconds);
  run.threads = bench::thread_description(at::get_num_threads());
  return run;
}

/// One pass through TrainLoop in mode `mode_name`. In a DDP rank this call does not return for
/// the fit() the rank was started for (the rank ends there).
template <class Model>
Run trainloop_run(const Config& c, const std::string& mode_name, const trainloop::data::AnyDataset<>& train,
                  int64_t max_steps = -1) {
  // The launching process keeps a DDP model on the CPU (ranks place it themselves).
  const torch::Device model_device = mode_name == "ddp" ? torch::Device(torch::kCPU) : c.device();
  Model net = seeded_model<Model>(c, model_device);
  auto optimizer = make_optimizer(c, net->parameters());
  trainloop::TrainLoop<Model, trainloop::gpu_mode::Any> loop(
      net, train, {}, *optimizer, torch::nn::CrossEntropyLoss(),
      trainloop::TrainLoopOptions().batch_size(c.batch_size).shuffle(false).seed(c.seed)
          .precision(trainloop::parse_precision(c.precision))
          .memory_format(trainloop::parse_memory_format(c.memory_format)),  // contiguous: the hand loop's
      make_mode(mode_name, c));
  const bool ddp = mode_name == "ddp";
  auto timer = std::make_shared<StepTimer>(c.device(), ddp ? c.ddp_steps_path() : std::string());
  const auto length = max_steps < 0 ? trainloop::FitLength::epochs(1) : trainloop::FitLength::iterations(max_steps);
  const auto start = Clock::now();
  const trainloop::History history = loop.fit(length, {timer});
  Run run;
  run.fit_seconds = std::chrono::duration<double>(Clock::now() - start).count();
  run.samples_per_second = history.last().samples_per_second;
  run.samples = history.last().samples;
  run.steps = history.total_steps;
  run.loss = history.last().train_loss;
  // In a rank, an earlier DDP fit() returns its recorded History without training: no step file.
  const bool launched_ranks = ddp && !trainloop::distributed::detect_rank_env();
  if (launched_ranks) run.step_seconds = read_step_file(c.ddp_steps_path());
  if (!ddp) run.step_seconds = timer->step_seconds();
  if (mode_name == "single") run.threads = bench::thread_description(at::get_num_threads());
  if (mode_name == "dp" || mode_name == "dp-unordered") {
    run.threads = std::to_string(c.replicas) + " replicas x " + std::to_string(trainloop::cpu::intra_op_threads_for(c.replicas)) +
                  " intra-op, OpenBLAS 1";
  }
  if (ddp) {
    run.threads = std::to_string(c.procs) + " ranks x " + std::to_string(trainloop::cpu::intra_op_threads_for(c.procs)) +
                  " intra-op, OpenBLAS " + trainloop::cpu::blas_threads_for_children().value_or("as set");
  }
  return run;
}

/// The order of the modes in repetition `rep` (0-based): rotated left by `rep`.
std::vector<std::string> rotated(const std::vector<std::string>& modes, int64_t rep) {
  std::vector<std::string> order;
  for (size_t i = 0; i < modes.size(); ++i)
    order.push_back(modes[(i + static_cast<size_t>(rep)) % modes.size()]);
  return order;
}

std::string step_note(const std::string& mode, const Config& c) {
  const std::string batch = std::to_string(c.batch_size);
  if (mode == "dp" || mode == "dp-unordered") return "step = " + batch + " samples split over " + std::to_string(c.replicas) + " replicas";
  if (mode == "ddp")
    return "step = " + std::to_string(c.procs) + " ranks x " + batch + " = " +
           std::to_string(c.procs * c.batch_size) + " samples; step times of rank 0";
  return "step = " + batch + " samples";
}

/// One line of the table.
struct Summary {
  std::string mode;
  double samples_per_second = 0.0;  // median over repetitions
  double step_ms_median = 0.0;      // over every step of every repetition
  double step_ms_p95 = 0.0;
  std::optional<double> ratio_to_hand;  // median over repetitions of the same-repetition ratio
  double fit_seconds = 0.0;             // median over repetitions
  int64_t steps = 0;                    // per repetition (last)
  double loss = 0.0;                    // last repetition
  std::string note;
  double min_rate = 0.0, max_rate = 0.0;  // over repetitions
  double gflops = 0.0;                    // median samples/s x training FLOPs per sample
  bool spread_exceeds_difference = false;  // (max - min) / median > |1 - vs hand|
  std::string threads;
};

std::vector<Summary> summarise(const Config& c, const std::map<std::string, std::vector<Run>>& runs) {
  std::vector<Summary> rows;
  const auto hand = runs.find("hand");
  for (const auto& mode : c.modes) {
    const auto& mode_runs = runs.at(mode);
    Summary s;
    s.mode = mode;
    std::vector<double> rates, fits, steps, ratios;
    for (size_t r = 0; r < mode_runs.size(); ++r) {
      rates.push_back(mode_runs[r].samples_per_second);
      fits.push_back(mode_runs[r].fit_seconds);
      for (double t : mode_runs[r].step_seconds) steps.push_back(t * 1e3);
      if (hand != runs.end()) ratios.push_back(mode_runs[r].samples_per_second / hand->second[r].samples_per_second);
    }
    s.samples_per_second = bench::median(rates);
    s.min_rate = *std::min_element(rates.begin(), rates.end());
    s.max_rate = *std::max_element(rates.begin(), rates.end());
    s.gflops = s.samples_per_second * flops_per_sample(c) / 1e9;
    s.threads = mode_runs.back().threads;
    s.step_ms_median = bench::median(steps);
    s.step_ms_p95 = bench::percentile(steps, 95.0);
    if (!ratios.empty()) s.ratio_to_hand = bench::median(ratios);
    if (s.ratio_to_hand && mode != "hand") {
      s.spread_exceeds_difference = (s.max_rate - s.min_rate) / s.samples_per_second > std::abs(1.0 - *s.ratio_to_hand);
    }
    s.fit_seconds = bench::median(fits);
    s.steps = mode_runs.back().steps;
    s.loss = mode_runs.back().loss;
    s.note = step_note(mode, c);
    rows.push_back(std::move(s));
  }
  return rows;
}

void print_table(const Config& c, const std::vector<Summary>& rows) {
  // On a GPU only --peak-gflops gives a peak; the CPU's sgemm says nothing about it.
  const double peak = c.peak_gflops > 0 ? c.peak_gflops : (c.device().is_cpu() ? bench::cpu_sgemm_gflops() : 0.0);
  std::printf("\n%-7s %11s %19s %10s %10s %8s %8s %7s %6s %7s %9s  %s\n", "mode", "samples/s", "min-max", "step med",
              "step p95", "vs hand", "GFLOP/s", "% peak", "steps", "fit s", "loss", "note");
  std::printf("%-7s %11s %19s %10s %10s %8s %8s %7s %6s %7s %9s\n", "", "(median)", "", "(ms)", "(ms)", "", "", "",
              "/rep", "", "(last)");
  for (const auto& s : rows) {
    char ratio[32], range[48];
    if (s.ratio_to_hand)
      std::snprintf(ratio, sizeof ratio, "%.3f%s", *s.ratio_to_hand, s.spread_exceeds_difference ? "*" : "");
    else
      std::snprintf(ratio, sizeof ratio, "-");
    std::snprintf(range, sizeof range, "%.1f-%.1f", s.min_rate, s.max_rate);
    std::printf("%-7s %11.1f %19s %10.2f %10.2f %8s %8.2f %6.1f%% %6lld %7.2f %9.5f  %s\n", s.mode.c_str(),
                s.samples_per_second, range, s.step_ms_median, s.step_ms_p95, ratio, s.gflops,
                peak > 0 ? 100.0 * s.gflops / peak : 0.0, static_cast<long long>(s.steps), s.fit_seconds, s.loss,
                s.note.c_str());
  }
  std::printf("\nthreads:");
  for (const auto& s : rows) std::printf("  %s: %s;", s.mode.c_str(), s.threads.c_str());
  std::printf("\n%.3f GFLOP per training sample (6 x forward multiply-adds); peak %.1f GFLOP/s fp32 (%s)\n",
              flops_per_sample(c) / 1e9, peak,
              c.peak_gflops > 0 ? "--peak-gflops" : (c.device().is_cpu() ? bench::cpu_peak_assumption().c_str() : "none on a GPU"));
  bool any_noisy = false;
  for (const auto& s : rows) any_noisy = any_noisy || s.spread_exceeds_difference;
  if (any_noisy) {
    std::printf("* the spread (max - min) / median of this mode's repetitions exceeds its difference to hand: "
                "the ratio is noise on this machine\n");
  }
}

void write_csv(const Config& c, const std::vector<Summary>& rows) {
  std::ofstream out(c.csv_path);
  TRAINLOOP_CHECK(out.good(), "cannot open ", c.csv_path, " for writing; expected a writable file path for --csv");
  out << "workload,mode,repetitions,samples_per_second_median,step_ms_median,step_ms_p95,ratio_to_hand,"
         "steps_per_repetition,fit_seconds_median,final_loss,note\n";
  out.precision(8);
  for (const auto& s : rows) {
    out << c.workload << ',' << s.mode << ',' << c.repetitions << ',' << s.samples_per_second << ','
        << s.step_ms_median << ',' << s.step_ms_p95 << ',';
    if (s.ratio_to_hand) out << *s.ratio_to_hand;
    out << ',' << s.steps << ',' << s.fit_seconds << ',' << s.loss << ",\"" << s.note << "\"\n";
  }
  TRAINLOOP_CHECK(out.good(), "writing ", c.csv_path, " failed");
}

template <class Model>
int run_benchmark(const Config& c, const bench::TensorPair& data) {
  const trainloop::data::AnyDataset<> train = trainloop::data::TensorDataset(data.inputs, data.targets, 10);
  const auto rank_env = trainloop::distributed::detect_rank_env();
  if (rank_env) {
    // A DDP rank re-running main(): replay the DDP fit() calls in the parent's order; the one
    // this rank was started for trains and ends the process, earlier ones return at once.
    TRAINLOOP_CHECK(rank_env->source == trainloop::distributed::RankEnvSource::Trainloop,
                    "compare_modes was started as a rank by ", trainloop::distributed::to_string(rank_env->source),
                    "; expected a plain process (it launches its DDP ranks itself)");
    for (int64_t rep = 0; rep < c.repetitions; ++rep)
      for (const auto& mode : rotated(c.modes, rep))
        if (mode == "ddp") trainloop_run<Model>(c, mode, train);
    return 0;
  }

  auto has = [&](const char* mode) { return std::find(c.modes.begin(), c.modes.end(), mode) != c.modes.end(); };
  if (c.warmup_batches > 0) {
    if (has("hand")) hand_run<Model>(c, data, c.warmup_batches);
    if (has("single")) trainloop_run<Model>(c, "single", train, c.warmup_batches);
    if (has("dp")) trainloop_run<Model>(c, "dp", train, c.warmup_batches);
    if (has("dp-unordered")) trainloop_run<Model>(c, "dp-unordered", train, c.warmup_batches);
  }

  std::map<std::string, std::vector<Run>> runs;
  for (int64_t rep = 0; rep < c.repetitions; ++rep) {
    std::printf("rep %lld:", static_cast<long long>(rep + 1));
    for (const auto& mode : rotated(c.modes, rep)) {
      Run run = mode == "hand" ? hand_run<Model>(c, data) : trainloop_run<Model>(c, mode, train);
      std::printf("  %s %.1f/s", mode.c_str(), run.samples_per_second);
      std::fflush(stdout);
      runs[mode].push_back(std::move(run));
    }
    std::printf("\n");
  }
  const auto rows = summarise(c, runs);
  print_table(c, rows);
  write_csv(c, rows);
  std::printf("\nwritten: %s\n", c.csv_path.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A hand-written libtorch loop vs TrainLoop in every gpu_mode on one workload"};
  Config c;
  app.add_option("--workload", c.workload, "cnn (Fashion-MNIST CNN) or mlp (wide MLP, synthetic data)")
      ->check(CLI::IsMember({"cnn", "mlp"}));
  app.add_option("--repetitions", c.repetitions, "timed passes of each mode, interleaved")->check(CLI::PositiveNumber);
  app.add_option("--samples", c.samples, "samples per pass (cnn: from the real training split; mlp: synthetic)")
      ->check(CLI::PositiveNumber);
  app.add_option("--batch-size", c.batch_size, "samples per batch (per rank in ddp)")->check(CLI::PositiveNumber);
  app.add_option("--warmup-batches", c.warmup_batches, "untimed batches of hand, single and dp before the repetitions")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--device", c.device_name, "cpu or cuda:N");
  app.add_option("--replicas", c.replicas, "dp: number of replicas (CPU replicas, or cuda:0..N-1)")
      ->check(CLI::PositiveNumber);
  app.add_option("--procs", c.procs, "ddp: number of ranks on this machine")->check(CLI::PositiveNumber);
  app.add_option("--threads", c.threads,
                 "intra-op threads for hand and single (0: libtorch's default; dp and ddp divide the cores)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--csv", c.csv_path, "write the table to this CSV file");
  app.add_option("--modes", c.modes, "comma-separated: hand,single,dp,dp-unordered,ddp")
      ->delimiter(',')
      ->check(CLI::IsMember({"hand", "single", "dp", "dp-unordered", "ddp"}));
  app.add_option("--data", c.data_dir, "directory with the Fashion-MNIST *-idx?-ubyte.gz files");
  app.add_option("--precision", c.precision, "TrainLoop's modes: fp32 or bf16 (the hand loop stays fp32)")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--memory-format", c.memory_format,
                 "TrainLoop's modes: contiguous (the hand loop's), channels-last or auto")
      ->check(CLI::IsMember({"contiguous", "channels-last", "auto"}));
  app.add_option("--seed", c.seed, "seed for the data, the weights and dropout");
  app.add_option("--peak-gflops", c.peak_gflops,
                 "the machine's fp32 peak for the % column; 0 measures a large sgemm on every core");
  app.add_option("--mlp-width", bench::mlp_shape().width, "mlp: units per hidden layer")->check(CLI::PositiveNumber);
  app.add_option("--mlp-layers", bench::mlp_shape().hidden_layers, "mlp: hidden layers")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);

  try {
    const auto rank_env = trainloop::distributed::detect_rank_env();
    const bool in_rank = rank_env.has_value();
    const torch::Device device = c.device();
    // A rank keeps the data on its own device, as single and dp keep it on theirs.
    const torch::Device data_device =
        in_rank && device.is_cuda() ? torch::Device(torch::kCUDA, static_cast<torch::DeviceIndex>(rank_env->local_rank))
                                    : device;
    if (!in_rank) {
      // hand and single run with libtorch's default intra-op thread count (printed below; on the
      // 2-core development box Debian's libtorch starts with 1), while dp replicas and ddp ranks
      // divide the usable cores between them. --threads sets the count for hand and single: on a
      // machine loaded by other processes, 2 OpenMP threads on 2 cores measured ~3x slower than 1.
      if (c.threads > 0) trainloop::cpu::apply_intra_op_threads(c.threads);
      std::printf("compare_modes: workload %s, %lld samples, batch size %lld, device %s, %d torch threads, "
                  "%lld repetitions (order rotated each), dp %d replicas, ddp %d ranks\n",
                  c.workload.c_str(), static_cast<long long>(c.samples), static_cast<long long>(c.batch_size),
                  device.str().c_str(), torch::get_num_threads(), static_cast<long long>(c.repetitions), c.replicas,
                  c.procs);
      if (c.workload == "mlp") {
        std::printf("mlp: 784 -> %lld x %lld -> 10, %.3f GFLOP per training sample (6 x multiply-adds)\n",
                    static_cast<long long>(bench::mlp_shape().width), static_cast<long long>(bench::mlp_shape().hidden_layers),
                    bench::mlp_shape().training_flops_per_sample() / 1e9);
      }
      std::fflush(stdout);
    }
    if (c.workload == "mlp") return run_benchmark<bench::WideMlp>(c, bench::synthetic_mlp_data(c.samples, c.seed, data_device));
    return run_benchmark<FashionNet>(c, bench::fashion_mnist_subset(c.data_dir, c.samples, c.seed, data_device));
  } catch (const std::exception& e) {
    std::cerr << "compare_modes: " << e.what() << '\n';
    return 1;
  }
}
