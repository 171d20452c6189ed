#define BOOST_TEST_MODULE test_sharded_evaluation
#include "unit_test.hpp"

// Evaluation under gpu_mode::FullyShardedDataParallel at sharding full, unit by unit: validation
// and predict() inside and after a fit equal plain DDP's (bit for bit on 2 ranks, where training
// is) and one process's, with evaluation sets whose shards have different batch counts and a rank
// without samples; no whole-model gather during a fit (the process's UnitGatherStats);
// EarlyStopping's best weights kept as shares and restored exactly as DDP restores them;
// whole_model_after_fit(false) leaves each rank its trained share.
//
// This program is also its own worker: run with TL_SEVAL_OUT set, it trains one scenario before
// Boost.Test's main() (the gate at the end of this file) and exits; fit() re-executes it once per
// rank (the environment, and so the gate, travels with them), as it does a user's program.

#include "ddp_test_model.hpp"
#include "test_support.hpp"

#include <trainloop/distributed/launch/free_port.hpp>
#include <trainloop/distributed/zero/unit_parameters.hpp>

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kBatch = 4;          // per rank, training and evaluation
constexpr int64_t kTrainSamples = 48;  // 2 or 3 ranks x batch 4 divide it: DDP and fsdp see the same steps

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : fallback;
}

/// Writes `key value` lines.
void write_numbers(const fs::path& path, const std::map<std::string, double>& numbers) {
  std::ofstream out(path);
  out.precision(17);
  for (const auto& [key, value] : numbers) out << key << ' ' << value << '\n';
}

std::map<std::string, double> read_numbers(const fs::path& path) {
  std::map<std::string, double> numbers;
  std::ifstream in(path);
  std::string key;
  double value;
  while (in >> key >> value) numbers[key] = value;
  return numbers;
}

/// This rank's UnitGatherStats into `<out>/<name>_rank<R>.txt`, on every rank (at on_fit_end:
/// after the last validation and EarlyStopping's restore, before end_fit's gather).
struct RecordGatherStats : tl::Callback {
  explicit RecordGatherStats(fs::path out) : out(std::move(out)) {}
  void on_fit_end(tl::TrainState& state, const tl::History&) override {
    const auto& stats = tl::distributed::unit_gather_stats();
    write_numbers(out / ("fit_end_rank" + std::to_string(state.rank) + ".txt"),
                  {{"whole_model_gathers", static_cast<double>(stats.whole_model_gathers)},
                   {"peak_unit_bytes_whole", static_cast<double>(stats.peak_unit_bytes_whole)}});
  }
  fs::path out;
};

/// At every epoch's end, on every rank: asks for the whole weights, records their sum into
/// `<out>/whole_rank<R>.txt`, and halves fc3's weight in them (a change the shares must keep).
struct HalveLastLayer : tl::Callback {
  explicit HalveLastLayer(fs::path out) : out(std::move(out)) {}
  void on_epoch_end(tl::TrainState& state, const tl::EpochRecord& record) override {
    auto whole = state.whole_weights();
    torch::NoGradGuard no_grad;
    auto& net = dynamic_cast<MlpImpl&>(*state.model);
    sums["sum_" + std::to_string(record.epoch)] = flat_params(net.parameters()).to(torch::kFloat64).sum().item<double>();
    net.fc3->weight.mul_(0.5);
    sums["gathers_" + std::to_string(record.epoch)] =
        static_cast<double>(tl::distributed::unit_gather_stats().whole_model_gathers);
    write_numbers(out / ("whole_rank" + std::to_string(state.rank) + ".txt"), sums);
  }
  fs::path out;
  std::map<std::string, double> sums;
};

/// The numbers of a History: per epoch its validation loss, samples and metrics, training loss.
std::map<std::string, double> history_numbers(const tl::History& history) {
  std::map<std::string, double> numbers;
  numbers["epochs"] = static_cast<double>(history.epochs.size());
  for (const auto& record : history.epochs) {
    const std::string epoch = std::to_string(record.epoch);
    numbers["train_loss_" + epoch] = record.train_loss;
    if (!record.validation) continue;
    numbers["val_loss_" + epoch] = record.validation->loss;
    numbers["val_samples_" + epoch] = static_cast<double>(record.validation->samples);
    for (const auto& [name, value] : record.validation->metrics) numbers["val_" + name + "_" + epoch] = value;
  }
  return numbers;
}

/// One scenario (TL_SEVAL_*): trains 4 epochs of SGD with momentum with validation, then
/// evaluate() and predict() after fit(); writes result.txt, params.pt and predictions.pt.
template <class Mode>
int run_scenario(Mode mode) {
  const fs::path out = env_or("TL_SEVAL_OUT", "");
  const int64_t validation_samples = std::stoll(env_or("TL_SEVAL_VAL", "9"));
  const int64_t epochs = std::stoll(env_or("TL_SEVAL_EPOCHS", "3"));
  const bool early = env_or("TL_SEVAL_EARLY", "0") == "1";
  const bool joined = std::getenv("RANK") != nullptr;
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const auto validation = make_data(validation_samples, 2);
  tl::TrainLoop<Mlp, Mode> loop(net, make_data(kTrainSamples, 1), validation, optimizer, torch::nn::CrossEntropyLoss(),
                                tl::TrainLoopOptions().batch_size(kBatch).eval_batch_size(kBatch).shuffle(false)
                                    .metrics({std::make_shared<tl::Accuracy>()}),
                                mode);
  // Best = the highest validation loss (the first epoch's, as the loss falls): a restore that
  // does something. Patience past the last epoch: no stop.
  auto stop = std::make_shared<tl::EarlyStopping>(
      tl::EarlyStoppingOptions("val_loss").mode(tl::MonitorMode::Max).patience(100).restore_best_weights(true));
  tl::CallbackList callbacks{std::make_shared<RecordGatherStats>(out)};
  if (early) callbacks.push_back(stop);
  if (env_or("TL_SEVAL_HALVE", "0") == "1") callbacks.push_back(std::make_shared<HalveLastLayer>(out));
  const tl::History history = loop.fit(epochs, callbacks);
  auto numbers = history_numbers(history);
  if (early) numbers["best_epoch"] = static_cast<double>(stop->best_epoch());
  if (joined) {
    // whole_model_after_fit(false), ranks started by hand: what each rank holds after fit().
    const std::string rank = env_or("RANK", "0");
    int64_t parameter_bytes = 0;
    for (const auto& parameter : net->parameters()) parameter_bytes += static_cast<int64_t>(parameter.storage().nbytes());
    numbers["parameter_bytes_after_fit"] = static_cast<double>(parameter_bytes);
    const tl::EvalResult after = loop.evaluate(validation);
    numbers["evaluate_loss"] = after.loss;
    numbers["evaluate_samples"] = static_cast<double>(after.samples);
    torch::save(loop.predict(validation), (out / ("predictions_rank" + rank + ".pt")).string());
    numbers["whole_model_gathers_after_evaluation"] =
        static_cast<double>(tl::distributed::unit_gather_stats().whole_model_gathers);
    loop.save_checkpoint(out / "after_fit.ckpt");  // gathers the model whole to write it
    write_numbers(out / ("result_rank" + rank + ".txt"), numbers);
    return 0;
  }
  // The launching process: the caller's model after fit(), evaluated here (whole, one process).
  const tl::EvalResult after = loop.evaluate(validation);
  numbers["evaluate_loss"] = after.loss;
  numbers["evaluate_samples"] = static_cast<double>(after.samples);
  if (validation_samples >= 3) torch::save(loop.predict(validation), (out / "predictions.pt").string());
  std::vector<torch::Tensor> params;
  for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
  torch::save(params, (out / "params.pt").string());
  write_numbers(out / "result.txt", numbers);
  return 0;
}

/// The worker's body: the mode TL_SEVAL_MODE names on TL_SEVAL_WORLD ranks. Exit status 0, 3 on a
/// trainloop::Error (its message printed), 4 on another exception.
int run_worker() {
  try {
    const std::string mode = env_or("TL_SEVAL_MODE", "full");
    const int world = std::stoi(env_or("TL_SEVAL_WORLD", "2"));
    const auto timeout = std::chrono::seconds(30);
    if (mode == "ddp") {
      return run_scenario(tl::gpu_mode::DistributedDataParallel().procs_per_node(world).device_type(torch::kCPU).timeout(timeout));
    }
    return run_scenario(tl::gpu_mode::FullyShardedDataParallel()
                            .procs_per_node(world)
                            .device_type(torch::kCPU)
                            .timeout(timeout)
                            .whole_model_after_fit(env_or("TL_SEVAL_KEEP_SHARES", "0") != "1"));
  } catch (const tl::Error& error) {
    std::cerr << "WORKER_ERROR: " << error.what() << std::endl;
    return 3;
  } catch (const std::exception& error) {
    std::cerr << "WORKER_EXCEPTION: " << error.what() << std::endl;
    return 4;
  }
}

// ---- the test side ----------------------------------------------------------------------------

struct Run {
  int exit_code = -1;
  std::string output;
  std::map<std::string, double> result;
};

/// This program as a worker of `mode` on `world` spawned ranks, writing into `out`.
Run run_spawned(const fs::path& out, const std::string& mode, int world, int64_t validation,
                const std::string& extra = "") {
  fs::create_directories(out / "tmp");
  const std::string command = "TMPDIR=" + (out / "tmp").string() + " TL_SEVAL_OUT=" + out.string() + " TL_SEVAL_MODE=" +
                              mode + " TL_SEVAL_WORLD=" + std::to_string(world) + " TL_SEVAL_VAL=" +
                              std::to_string(validation) + " " + extra + " " + fs::read_symlink("/proc/self/exe").string() +
                              " 2>&1";
  const CommandRun job = run_command(command);
  return Run{job.exit_code, job.output, read_numbers(out / "result.txt")};
}

/// One process on the combined batch (what `world` ranks of batch 4 train together): its History.
tl::History one_process(int world, int64_t validation_samples, torch::Tensor* predictions = nullptr) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const auto validation = make_data(validation_samples, 2);
  tl::TrainLoop<Mlp> loop(net, make_data(kTrainSamples, 1), validation, optimizer, torch::nn::CrossEntropyLoss(),
                          tl::TrainLoopOptions().batch_size(kBatch * world).eval_batch_size(kBatch).shuffle(false)
                              .metrics({std::make_shared<tl::Accuracy>()}));
  tl::History history = loop.fit(3);
  if (predictions != nullptr) *predictions = loop.predict(validation);
  return history;
}

torch::Tensor load_tensor(const fs::path& path) {
  torch::Tensor tensor;
  torch::load(tensor, path.string());
  return tensor;
}

torch::Tensor load_params(const fs::path& path) {
  std::vector<torch::Tensor> params;
  torch::load(params, path.string());
  return flat_params(params);
}

/// The bytes of the largest unit's buffer (W chunks of ceil(n / W) floats): fc2, 272 elements.
int64_t largest_unit_bytes(int world) { return world * ((272 + world - 1) / world) * 4; }

}  // namespace

// Shards of 9 samples on 2 ranks: 5 and 4 (2 and 1 batches of 4); of 13 on 3: 5, 4, 4 (2, 1, 1);
// 1 sample on 2 ranks and 2 on 3 leave the last rank none. Validation after each epoch and
// predict() after fit() equal plain DDP's (bit for bit on 2 ranks) and one process's, and no rank
// gathered the whole model during the fit: at most the largest unit was whole at once.
BOOST_AUTO_TEST_CASE(validation_and_predict_at_full_equal_ddp_and_one_process_without_a_whole_model_gather) {
  struct Case {
    int world;
    int64_t validation;
  };
  for (const Case c : {Case{2, 9}, Case{3, 13}, Case{2, 1}, Case{3, 2}}) {
    BOOST_TEST_CONTEXT("world " << c.world << ", " << c.validation << " validation samples") {
      TempDir dir("tl-sharded-eval");
      const Run ddp = run_spawned(dir.path / "ddp", "ddp", c.world, c.validation);
      BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
      const Run full = run_spawned(dir.path / "full", "full", c.world, c.validation);
      BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
      torch::Tensor single_predictions;
      const tl::History single = one_process(c.world, c.validation, &single_predictions);
      // 2 ranks sum as plain DDP does: equal bit for bit. 3 ranks: the reduce-scatter's order (6e-8).
      const double same_run = c.world == 2 ? 0.0 : 1e-6;
      BOOST_TEST(full.result.at("epochs") == 3);
      for (int epoch = 1; epoch <= 3; ++epoch) {
        const std::string e = std::to_string(epoch);
        BOOST_TEST(full.result.at("val_samples_" + e) == c.validation);
        BOOST_TEST(ddp.result.at("val_samples_" + e) == c.validation);
        BOOST_TEST(std::abs(full.result.at("val_loss_" + e) - ddp.result.at("val_loss_" + e)) <= same_run);
        BOOST_TEST(std::abs(full.result.at("train_loss_" + e) - ddp.result.at("train_loss_" + e)) <= same_run);
        BOOST_TEST(full.result.at("val_accuracy_" + e) == ddp.result.at("val_accuracy_" + e));
        const auto& reference = *single.epochs.at(static_cast<size_t>(epoch - 1)).validation;
        BOOST_TEST(std::abs(full.result.at("val_loss_" + e) - reference.loss) <= 1e-5);
        BOOST_TEST(full.result.at("val_accuracy_" + e) == reference.metrics.at("accuracy"));
      }
      BOOST_TEST_MESSAGE("world " << c.world << ", " << c.validation << " samples: val loss epoch 3 full "
                         << full.result.at("val_loss_3") << ", ddp " << ddp.result.at("val_loss_3") << ", one process "
                         << single.epochs.back().validation->loss);
      // evaluate() after fit(): the caller's model, whole (end_fit gathered it), as the last validation.
      BOOST_TEST(full.result.at("evaluate_samples") == c.validation);
      BOOST_TEST(std::abs(full.result.at("evaluate_loss") - full.result.at("val_loss_3")) <= 1e-6);
      BOOST_TEST((load_params(dir.path / "full" / "params.pt") - load_params(dir.path / "ddp" / "params.pt"))
                     .abs().max().item<double>() <= same_run);
      if (c.validation >= c.world) {
        const torch::Tensor full_predictions = load_tensor(dir.path / "full" / "predictions.pt");
        BOOST_REQUIRE(full_predictions.size(0) == c.validation);
        BOOST_TEST((full_predictions - load_tensor(dir.path / "ddp" / "predictions.pt")).abs().max().item<double>() <= same_run);
        BOOST_TEST((full_predictions - single_predictions).abs().max().item<double>() <= 1e-5);
      }
      for (int rank = 0; rank < c.world; ++rank) {
        const auto stats = read_numbers(dir.path / "full" / ("fit_end_rank" + std::to_string(rank) + ".txt"));
        BOOST_TEST_MESSAGE("rank " << rank << ": whole-model gathers " << stats.at("whole_model_gathers")
                           << ", peak unit bytes whole " << stats.at("peak_unit_bytes_whole") << " (whole model "
                           << c.world * ((112 + c.world - 1) / c.world + (272 + c.world - 1) / c.world +
                                         (51 + c.world - 1) / c.world) * 4 << ")");
        BOOST_TEST(stats.at("whole_model_gathers") == 0);
        BOOST_TEST(stats.at("peak_unit_bytes_whole") == largest_unit_bytes(c.world));
      }
    }
  }
}

// EarlyStopping keeps the best epoch (the first: it watches for the highest val_loss) as this
// rank's shares at full and puts them back: the model after fit() is DDP's restored one bit for
// bit, and not the last epoch's.
BOOST_AUTO_TEST_CASE(early_stopping_at_full_restores_exactly_the_weights_plain_ddp_restores) {
  TempDir dir("tl-sharded-early");
  const Run ddp = run_spawned(dir.path / "ddp", "ddp", 2, 9, "TL_SEVAL_EARLY=1");
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  const Run full = run_spawned(dir.path / "full", "full", 2, 9, "TL_SEVAL_EARLY=1");
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  const Run last = run_spawned(dir.path / "last", "full", 2, 9);
  BOOST_REQUIRE_MESSAGE(last.exit_code == 0, last.output);
  BOOST_TEST(full.result.at("best_epoch") == 1);
  BOOST_TEST(ddp.result.at("best_epoch") == 1);
  const torch::Tensor restored = load_params(dir.path / "full" / "params.pt");
  BOOST_TEST(torch::equal(restored, load_params(dir.path / "ddp" / "params.pt")));
  BOOST_TEST((restored - load_params(dir.path / "last" / "params.pt")).abs().max().item<double>() > 1e-3);
  // The restored model evaluates to epoch 1's validation loss.
  BOOST_TEST(std::abs(full.result.at("evaluate_loss") - full.result.at("val_loss_1")) <= 1e-6);
  for (int rank = 0; rank < 2; ++rank) {
    const auto stats = read_numbers(dir.path / "full" / ("fit_end_rank" + std::to_string(rank) + ".txt"));
    BOOST_TEST(stats.at("whole_model_gathers") == 0);  // kept and restored as shares
  }
}

// A callback that asks for the whole weights at every epoch's end (state.whole_weights(), on every
// rank) sees DDP's weights, one whole-model gather each time, and what it changes in them stays:
// halving fc3's weight every epoch ends as DDP doing the same, bit for bit.
BOOST_AUTO_TEST_CASE(a_callback_asking_for_the_whole_weights_at_full_sees_and_changes_what_ddp_does) {
  TempDir dir("tl-sharded-whole");
  const Run ddp = run_spawned(dir.path / "ddp", "ddp", 2, 9, "TL_SEVAL_HALVE=1");
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  const Run full = run_spawned(dir.path / "full", "full", 2, 9, "TL_SEVAL_HALVE=1");
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  const Run plain = run_spawned(dir.path / "plain", "ddp", 2, 9);
  BOOST_REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  const torch::Tensor halved = load_params(dir.path / "full" / "params.pt");
  BOOST_TEST(torch::equal(halved, load_params(dir.path / "ddp" / "params.pt")));
  BOOST_TEST((halved - load_params(dir.path / "plain" / "params.pt")).abs().max().item<double>() > 1e-3);
  const auto ddp_sums = read_numbers(dir.path / "ddp" / "whole_rank0.txt");
  for (int rank = 0; rank < 2; ++rank) {
    const auto sums = read_numbers(dir.path / "full" / ("whole_rank" + std::to_string(rank) + ".txt"));
    for (int epoch = 1; epoch <= 3; ++epoch) {
      const std::string e = std::to_string(epoch);
      BOOST_TEST(sums.at("sum_" + e) == ddp_sums.at("sum_" + e));
      BOOST_TEST(sums.at("gathers_" + e) == epoch);  // one whole-model gather per request, none besides
    }
  }
}

// whole_model_after_fit(false), ranks started by hand (torchrun's variables): after fit() each
// rank's parameters have no memory, evaluate() and predict() gather unit by unit (still no
// whole-model gather) and equal DDP's, and a checkpoint holds the trained weights. The launcher
// refuses the setting by name.
BOOST_AUTO_TEST_CASE(whole_model_after_fit_false_leaves_each_rank_its_trained_share) {
  TempDir dir("tl-sharded-keep");
  const Run ddp = run_spawned(dir.path / "ddp", "ddp", 2, 9);
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  const fs::path out = dir.path / "joined";
  fs::create_directories(out / "tmp");
  const int port = tl::distributed::find_free_port();
  std::string command = "(";
  for (int rank = 0; rank < 2; ++rank) {
    command += "TMPDIR=" + (out / "tmp").string() + " TL_SEVAL_OUT=" + out.string() +
               " TL_SEVAL_MODE=full TL_SEVAL_WORLD=2 TL_SEVAL_VAL=9 TL_SEVAL_KEEP_SHARES=1 WORLD_SIZE=2 "
               "LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " RANK=" +
               std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) + " " +
               fs::read_symlink("/proc/self/exe").string() + (rank == 0 ? " & " : "; wait");
  }
  command += ") 2>&1";
  const CommandRun joined = run_command(command);
  for (int rank = 0; rank < 2; ++rank) {
    BOOST_TEST_CONTEXT("rank " << rank) {
      const auto result = read_numbers(out / ("result_rank" + std::to_string(rank) + ".txt"));
      BOOST_REQUIRE_MESSAGE(!result.empty(), joined.output);
      BOOST_TEST(result.at("parameter_bytes_after_fit") == 0);  // its model holds no whole weights
      BOOST_TEST(result.at("whole_model_gathers_after_evaluation") == 0);
      BOOST_TEST(result.at("evaluate_samples") == 9);
      BOOST_TEST(result.at("evaluate_loss") == ddp.result.at("val_loss_3"));  // the trained shares, unit by unit
      BOOST_TEST(result.at("val_loss_3") == ddp.result.at("val_loss_3"));
      BOOST_TEST(torch::equal(load_tensor(out / ("predictions_rank" + std::to_string(rank) + ".pt")),
                              load_tensor(dir.path / "ddp" / "predictions.pt")));
    }
  }
  // The checkpoint written after fit() holds the trained weights: DDP's, bit for bit.
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  tl::TrainLoop<Mlp> one(net, make_data(kTrainSamples, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                         tl::TrainLoopOptions().batch_size(kBatch));
  one.load_checkpoint(out / "after_fit.ckpt");
  BOOST_TEST(torch::equal(flat_params(net->parameters()), load_params(dir.path / "ddp" / "params.pt")));

  const Run refused = run_spawned(dir.path / "refused", "full", 2, 9, "TL_SEVAL_KEEP_SHARES=1");
  BOOST_TEST(refused.exit_code == 3, refused.output);
  BOOST_TEST(refused.output.find("fsdp's whole_model_after_fit is false in a program that launches its own ranks; "
                                 "expected ranks started by torchrun, srun or mpirun") != std::string::npos,
             refused.output);
}

namespace {
// The worker's gate: before Boost.Test's main(), in the process a test case started and in every
// rank fit() re-executes from it.
const bool worker_gate = [] {
  if (std::getenv("TL_SEVAL_OUT") == nullptr) return false;
  std::cout.flush();
  std::exit(run_worker());
}();
}  // namespace
