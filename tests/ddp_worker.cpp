// A program that trains with gpu_mode::DistributedDataParallel, driven by test_ddp, test_sharding,
// test_comm_hooks and test_equivalence (helpers: ddp_test_support.hpp), and by test_mpirun,
// test_torchrun, test_multinode and test_recipe.
// fit() re-executes this program once per rank, exactly as it does for a user's program.
//
//   ddp_worker <scenario> <world> <out-dir> [port]
//
// Scenarios: train (equivalence), accumulate, twofits, eval97, eval99, throw, sigkill, segv,
// exit0, checkpoint_error, bad_label, oom, retry_after_oom, long, sigchld_ignored, sigchld_handler,
// throw_before_fit, lr_between_fits, evaluate_everywhere, two_loops, stop_on_rank1, sharded_model_changes,
// slow (a rank slowed in one part of its steps: TL_TEST_SLOW, TL_TEST_STEPS)
// (joined ranks), ckpt (checkpoints, resume
// and restarts, set by TL_TEST_EPOCHS, TL_TEST_CKPT_DIR, TL_TEST_EVERY_STEPS, TL_TEST_RESUME,
// TL_TEST_KILL_AT_STEP, TL_TEST_MAX_RESTARTS; with TL_TEST_OPTIMIZER=adam, TL_TEST_ZERO=1 or
// TL_TEST_SHARDING=<level> (TL_TEST_SHARDING_UNITS=<one submodule>), TL_TEST_CLIP_PERCENT=N and
// TL_TEST_ACCUMULATION=K for ZeRO, TL_TEST_COMM_HOOK=<name> for a comm hook; TL_TEST_ELASTIC=1,
// TL_TEST_REPLACEMENTS=N, TL_TEST_ELASTIC_WAIT_MS=N and TL_TEST_TRAIN_SAMPLES=N for elastic training;
// TL_TEST_NORM=1: the model with a BatchNorm layer).
// It writes <out-dir>/params.pt (the trained parameters, as the caller's model holds them after
// fit()) and <out-dir>/result.txt (numbers the test compares). Exit status: 0 on success, 3 on
// a trainloop::Error (after printing its message; "RANK_FAILED rank=N" for a RankFailedError),
// 4 on a c10::Error, 5 on a c10::OutOfMemoryError; a CheckpointError is a trainloop::Error (3)
// printed as "CHECKPOINT_ERROR: ..." ("NESTED rank=N type=T" when a RankFailedError is nested in it).

#include "ddp_test_model.hpp"

#include <c10/util/Exception.h>

#include <csignal>
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <numeric>
#include <iostream>
#include <thread>
#include <sys/wait.h>
#include <unistd.h>

namespace tl = trainloop;

namespace {

/// This process's rank when it is one (own launcher, torchrun or mpirun variables), else -1.
int own_rank() {
  for (const char* name : {"TRAINLOOP_RANK", "RANK", "OMPI_COMM_WORLD_RANK"}) {
    if (const char* value = std::getenv(name)) return std::atoi(value);
  }
  return -1;
}

/// Sleeps before each micro-batch's forward: the step's input part (its phase is still loading).
struct SleepBeforeForward : tl::Callback {
  explicit SleepBeforeForward(std::chrono::milliseconds p) : pause(p) {}
  void on_train_batch(tl::TrainState&, torch::Tensor&, torch::Tensor&) override {
    std::this_thread::sleep_for(pause);
  }
  std::chrono::milliseconds pause;
};

/// Writes every straggler record the loop hands the callbacks (on_straggler, the main process) to
/// <dir>/stragglers.txt: "<rank> <part> <ended>" per line.
struct StragglerLog : tl::Callback {
  explicit StragglerLog(std::string d) : dir(std::move(d)) {}
  void on_straggler(tl::TrainState& state, const tl::StragglerRecord& record) override {
    TRAINLOOP_CHECK(state.is_main, "on_straggler on rank ", state.rank, "; expected the main process only");
    std::ofstream(dir + "/stragglers.txt", std::ios::app) << record.rank << ' ' << record.part << ' ' << record.ended << '\n';
  }
  std::string dir;
};

/// Fails one rank on purpose, from inside training.
struct FailOnRank : tl::Callback {
  std::string how;
  explicit FailOnRank(std::string h) : how(std::move(h)) {}
  void on_batch_end(tl::TrainState& state) override {
    if (own_rank() != 1) return;
    if (how == "throw" && state.epoch == 2 && state.batch == 2) throw std::runtime_error("rank one gave up in epoch 2");
    if (how == "checkpoint_error" && state.epoch == 1 && state.batch == 2) {
      throw tl::CheckpointError("trainloop: checkpoint /shared/ckpt/epoch3.ckpt is truncated; expected a whole file");
    }
    if (how == "sigkill" && state.epoch == 1 && state.batch == 3) std::raise(SIGKILL);
    if (how == "segv" && state.epoch == 1 && state.batch == 3) std::raise(SIGSEGV);
    if (how == "exit0" && state.epoch == 1 && state.batch == 3) std::exit(0);  // user code ending the program
  }
};

/// Leaves `<dir>/rank<R>.pid` once training began, then trains slowly (for killing the launcher).
struct SlowAndVisible : tl::Callback {
  std::string dir;
  explicit SlowAndVisible(std::string d) : dir(std::move(d)) {}
  void on_fit_begin(tl::TrainState&) override {
    std::ofstream(dir + "/rank" + std::to_string(own_rank()) + ".pid") << ::getpid();
  }
  void on_batch_end(tl::TrainState&) override { std::this_thread::sleep_for(std::chrono::milliseconds(50)); }
};

/// The test MLP, but its forward throws a libtorch out-of-memory error on rank 1 (as a CUDA
/// allocation would) for batches of more than `oom_above` samples, to check that the error keeps
/// its type on its way to the caller, and that a caller can retry with a smaller batch.
int64_t oom_above = 0;
struct OomOnRank1Impl : MlpImpl {
  torch::Tensor forward(torch::Tensor x) {
    if (own_rank() == 1 && x.size(0) > oom_above) C10_THROW_ERROR(OutOfMemoryError, "simulated: CUDA out of memory on rank 1");
    return MlpImpl::forward(x);
  }
};
TORCH_MODULE(OomOnRank1);

/// Asks to stop on rank 1 only, at a global step: every rank must stop after that same step.
struct StopOnRank1 : tl::Callback {
  void on_step_end(tl::TrainState& state) override {
    if (own_rank() == 1 && state.global_step == 3) state.request_stop("rank 1 has seen enough");
  }
};

/// Counts optimizer steps, and keeps the count in checkpoints (and across spawned fits).
struct StepCounter : tl::Callback {
  int64_t steps = 0;
  void on_step_end(tl::TrainState&) override { ++steps; }
  void save_state(torch::serialize::OutputArchive& archive) const override { archive.write("steps", c10::IValue(steps)); }
  void load_state(torch::serialize::InputArchive& archive) override {
    c10::IValue value;
    archive.read("steps", value);
    steps = value.toInt();
  }
};

/// SIGKILLs rank 1 at a global step, on the first attempt only (not after a restart).
struct KillRank1AtStep : tl::Callback {
  int64_t step;
  explicit KillRank1AtStep(int64_t s) : step(s) {}
  void on_step_end(tl::TrainState& state) override {
    const bool restarted = std::atoi(std::getenv("TRAINLOOP_RESTART_COUNT") ? std::getenv("TRAINLOOP_RESTART_COUNT") : "0") > 0 ||
                           std::atoi(std::getenv("TORCHELASTIC_RESTART_COUNT") ? std::getenv("TORCHELASTIC_RESTART_COUNT") : "0") > 0;
    if (own_rank() == 1 && !restarted && state.global_step == step) std::raise(SIGKILL);
  }
};

int64_t env_number(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value && *value ? std::atoll(value) : fallback;
}

/// A program's own SIGCHLD handler that reaps every child (some servers have one).
void reap_every_child(int) {
  while (::waitpid(-1, nullptr, WNOHANG) > 0) {
  }
}

/// Writes, from every rank, the learning rate of each of its optimizer steps (lrs_rank<r>.txt).
struct LrRecorder : tl::Callback {
  std::string dir;
  std::vector<double> lrs;
  explicit LrRecorder(std::string d) : dir(std::move(d)) {}
  void on_before_optimizer_step(tl::TrainState& s) override { lrs.push_back(tl::learning_rate_of(*s.optimizer)); }
  void on_fit_end(tl::TrainState& s, const tl::History&) override {
    std::ofstream out(dir + "/lrs_rank" + std::to_string(s.rank) + ".txt");
    out.precision(17);
    for (double lr : lrs) out << lr << '\n';
  }
};

/// Writes, from every rank, the global step and epochs at the end of the fit (stop_rank<r>.txt).
struct StopRecorder : tl::Callback {
  std::string dir;
  explicit StopRecorder(std::string d) : dir(std::move(d)) {}
  void on_fit_end(tl::TrainState& s, const tl::History& h) override {
    std::ofstream(dir + "/stop_rank" + std::to_string(s.rank) + ".txt") << s.global_step << '\n' << h.epochs.size() << '\n';
  }
};

void write_eval(std::ofstream& out, const std::string& name, const tl::EvalResult& result) {
  out << name << "_loss " << result.loss << '\n'
      << name << "_samples " << result.samples << '\n'
      << name << "_accuracy " << result.metrics.at("accuracy") << '\n';
}

}  // namespace

/// Rank 0, at the end of the fit: per checkpoint, "<written behind training> <failed>" (test_sharded_checkpoint).
struct CheckpointReportsLog : tl::Callback {
  CheckpointReportsLog(std::string directory, std::shared_ptr<tl::ModelCheckpoint> watched)
      : dir(std::move(directory)), checkpoints(std::move(watched)) {}
  bool main_process_only() const override { return true; }
  void on_fit_end(tl::TrainState&, const tl::History&) override {
    std::ofstream out(dir + "/reports.txt");
    for (const tl::CheckpointReport& report : checkpoints->reports()) out << report.background << ' ' << (report.error ? 1 : 0) << '\n';
  }
  std::string dir;
  std::shared_ptr<tl::ModelCheckpoint> checkpoints;
};

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: ddp_worker <scenario> <world> <out-dir> [port]\n";
    return 2;
  }
  const std::string scenario = argv[1];
  const int world = std::stoi(argv[2]);
  const std::string out_dir = argv[3];
  const int port = argc > 4 ? std::stoi(argv[4]) : 0;
  if (scenario == "sigchld_ignored") std::signal(SIGCHLD, SIG_IGN);  // some programs do this
  if (scenario == "sigchld_handler") std::signal(SIGCHLD, reap_every_child);
  if (scenario == "throw_before_fit" && own_rank() == 1) {
    // User code before fit() failing in one rank only: escapes main() in that rank.
    throw std::runtime_error("rank 1 could not open its shard of the data");
  }
  try {
    // TL_TEST_SEED_BY_RANK: rank r builds its model from another seed than the caller (test_ddp:
    // spawned ranks must still start from the caller's weights, which they load, not broadcast).
    const bool seed_by_rank = std::getenv("TL_TEST_SEED_BY_RANK") != nullptr;
    torch::manual_seed(seed_by_rank ? 5 + 1000 * static_cast<uint64_t>(std::max(own_rank(), 0)) : 5);
    // TL_TEST_HIDDEN=2048: a gathered checkpoint goes behind training; TL_TEST_NORM=1: with BatchNorm (buffers).
    Mlp net(env_number("TL_TEST_HIDDEN", 16), env_number("TL_TEST_NORM", 0) != 0);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    // TL_TEST_OPTIMIZER=adam: the main loop trains with Adam instead (ZeRO's tests: two moments per parameter).
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
    // TL_TEST_OPTIMIZER=adamw: with weight decay, which moves a parameter stepped with a zero gradient.
    torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(0.01).weight_decay(0.1));
    const std::string optimizer_name = std::getenv("TL_TEST_OPTIMIZER") ? std::getenv("TL_TEST_OPTIMIZER") : "sgd";
    torch::optim::Optimizer& trained_optimizer = optimizer_name == "adam"    ? static_cast<torch::optim::Optimizer&>(adam)
                                                 : optimizer_name == "adamw" ? static_cast<torch::optim::Optimizer&>(adamw)
                                                                             : optimizer;
    // TL_TEST_FREEZE_FIRST=1: fc1 frozen (still in the optimizer), as a fine-tuned backbone.
    if (env_number("TL_TEST_FREEZE_FIRST", 0) != 0) {
      for (auto& p : net->fc1->parameters()) p.requires_grad_(false);
    }
    auto mode = tl::gpu_mode::DistributedDataParallel()
                    .procs_per_node(world)
                    .device_type(torch::kCPU)
                    .master_port(port)
                    .timeout(std::chrono::seconds(20))
                    .first_bucket_cap_bytes(256)  // several buckets even for a small model
                    .bucket_cap_bytes(1024);
    // TL_TEST_ELASTIC=1: a lost rank's survivors go on (test_elastic; TRAINLOOP_TEST_KILL_AT kills one).
    mode.elastic(env_number("TL_TEST_ELASTIC", 0) != 0);
    tl::gpu_mode::Any chosen;  // the mode the main loop trains with: `mode`, unless TL_TEST_SHARDING asks for fsdp
    auto options = tl::TrainLoopOptions().batch_size(4).shuffle(false).metrics({std::make_shared<tl::Accuracy>()});
    // Multi-node runs (test_multinode) say where this "machine" sits; `world` is then per node.
    const int nnodes = std::getenv("TL_TEST_NNODES") ? std::stoi(std::getenv("TL_TEST_NNODES")) : 1;
    if (nnodes > 1) {
      mode.nnodes(nnodes).node_rank(std::stoi(std::getenv("TL_TEST_NODE_RANK"))).master_addr(std::getenv("TL_TEST_MASTER_ADDR"));
    }
    const int total_world = world * nnodes;
    int64_t train_size = 4 * total_world * 5, epochs = 1, val_size = 40;
    tl::CallbackList callbacks;
    if (scenario == "accumulate") options.grad_accumulation_steps(2), train_size *= 2;
    if (scenario == "eval97" || scenario == "eval99") {
      train_size = val_size = scenario == "eval97" ? 97 : 99;
      options.batch_size(8).shuffle(true);
      epochs = 2;
    }
    if (scenario == "throw" || scenario == "sigkill" || scenario == "segv" || scenario == "exit0" ||
        scenario == "checkpoint_error") {
      callbacks.push_back(std::make_shared<FailOnRank>(scenario));
      epochs = 3;
      // Failure must be caught by the launcher, not a timeout (ddp_test_support.hpp's kFailureTimeoutSeconds).
      mode.timeout(std::chrono::seconds(60));
    }
    std::string resume;
    std::shared_ptr<StepCounter> counter;
    if (scenario == "ckpt") {
      // Checkpoints, resume and restarts, driven by TL_TEST_* variables (ddp_test_support.hpp: run_ckpt).
      epochs = env_number("TL_TEST_EPOCHS", 2);
      options.shuffle(true);
      auto checkpointer = std::make_shared<tl::ModelCheckpoint>(
          tl::ModelCheckpointOptions(std::getenv("TL_TEST_CKPT_DIR"))
              .every_n_steps(env_number("TL_TEST_EVERY_STEPS", 0))
              .keep_last(0)
              .in_background(env_number("TL_TEST_BACKGROUND", 1) != 0));  // 0: training waits (test_sharded_checkpoint)
      callbacks.push_back(checkpointer);
      callbacks.push_back(std::make_shared<CheckpointReportsLog>(out_dir, checkpointer));
      if (const int64_t kill_at = env_number("TL_TEST_KILL_AT_STEP", 0)) callbacks.push_back(std::make_shared<KillRank1AtStep>(kill_at));
      mode.max_restarts(static_cast<int>(env_number("TL_TEST_MAX_RESTARTS", 0)));
      resume = std::getenv("TL_TEST_RESUME") ? std::getenv("TL_TEST_RESUME") : "";
      mode.zero(env_number("TL_TEST_ZERO", 0) != 0);
      // TL_TEST_ELASTIC_WAIT_MS: how long a rank that may be gone is waited for (a replacement's rendezvous).
      if (const int64_t wait = env_number("TL_TEST_ELASTIC_WAIT_MS", 0)) mode.elastic_wait(std::chrono::milliseconds(wait));
      // TL_TEST_REPLACEMENTS=n: the launcher starts replacements of a lost rank (0 here unless asked:
      // the other cases compare with a world that only shrank).
      mode.max_replacements(static_cast<int>(env_number("TL_TEST_REPLACEMENTS", 0)));
      // TL_TEST_TRAIN_SAMPLES: the same data whatever the world size (a run resumed on fewer ranks).
      if (const int64_t samples = env_number("TL_TEST_TRAIN_SAMPLES", 0)) train_size = samples;
      if (const char* level = std::getenv("TL_TEST_SHARDING")) {  // optimizer: ddp's zero; gradients, full: fsdp
        const tl::distributed::Sharding sharding = tl::distributed::sharding_named(level);
        if (sharding == tl::distributed::Sharding::Optimizer) mode.zero(true);
        if (sharding >= tl::distributed::Sharding::Gradients) {
          auto fsdp = tl::gpu_mode::FullyShardedDataParallel().processes_like(mode).sharding(sharding);
          if (const char* units = std::getenv("TL_TEST_SHARDING_UNITS")) fsdp.sharding_units({units});
          chosen = fsdp;
        }
      }
      if (const char* hook = std::getenv("TL_TEST_COMM_HOOK")) mode.comm_hook(tl::distributed::comm_hook_named(hook));
      if (const int64_t clip = env_number("TL_TEST_CLIP_PERCENT", 0)) options.clip_grad_norm(static_cast<double>(clip) / 100.0);
      options.grad_accumulation_steps(env_number("TL_TEST_ACCUMULATION", 1));
    }
    if (scenario == "uneven") {  // test_ddp: exact uneven batches (ddp_test_model.hpp's uneven_reference)
      train_size = kUnevenSamples;
      epochs = kUnevenEpochs;
      options.shuffle(true).seed(3).grad_accumulation_steps(env_number("TL_TEST_ACCUMULATION", 1));
      options.exact_uneven_batches(env_number("TL_TEST_EXACT", 1) != 0);
      callbacks.push_back(std::make_shared<SaveParamsEachEpoch>(out_dir));
    }
    if (scenario == "stop_on_rank1") callbacks.push_back(std::make_shared<StopOnRank1>());
    if (scenario == "one_cycle") {  // test_recipe: the schedule on every rank
      callbacks.push_back(std::make_shared<tl::OneCycle>(tl::OneCycleOptions(0.1)));
      callbacks.push_back(std::make_shared<LrRecorder>(out_dir));
      epochs = 2;
    }
    if (scenario == "early_stop") {  // test_recipe: a constant "lr" never improves after epoch 1
      callbacks.push_back(std::make_shared<tl::EarlyStopping>(tl::EarlyStoppingOptions("lr").patience(2)));
      callbacks.push_back(std::make_shared<StopRecorder>(out_dir));
      epochs = 10;
    }
    if (scenario == "twofits") {
      counter = std::make_shared<StepCounter>();
      callbacks.push_back(counter);
    }
    if (scenario == "long") {
      callbacks.push_back(std::make_shared<SlowAndVisible>(out_dir));
      epochs = 1000;
    }
    auto train = make_data(train_size, 1);
    auto val = make_data(val_size, 2);
    if (scenario == "bad_label") {
      // Sample 21 is rank 1's (odd indices, in order) third batch: past the loop's first-batch label
      // check, so libtorch's criterion is what fails, deep in a later batch.
      auto targets = train.targets().clone();
      targets[21] = 7;
      train = tl::data::TensorDataset(train.inputs(), targets);
    }

    if (scenario == "oom" || scenario == "retry_after_oom") {
      oom_above = 2;
      OomOnRank1 oom_net;
      torch::optim::SGD oom_optimizer(oom_net->parameters(), torch::optim::SGDOptions(0.05));
      tl::TrainLoop<OomOnRank1, tl::gpu_mode::DistributedDataParallel> loop(
          oom_net, train, {}, oom_optimizer, torch::nn::CrossEntropyLoss(), options, mode);
      int retried = 0;
      try {
        loop.fit(1);
      } catch (const c10::OutOfMemoryError&) {
        if (scenario == "oom") throw;
        // What users do: back off the batch size and try again. The ranks of this second
        // launch pass the first fit() again, which must throw there too, so they get here.
        retried = 1;
        tl::TrainLoop<OomOnRank1, tl::gpu_mode::DistributedDataParallel> smaller(
            oom_net, train, {}, oom_optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions(options).batch_size(2),
            mode);
        smaller.fit(1);
      }
      std::ofstream(out_dir + "/result.txt") << "retried " << retried << '\n';
      return 0;
    }

    if (scenario == "evaluate_everywhere" || scenario == "two_loops") {
      // Run by the test as torchrun would (RANK, WORLD_SIZE, ... set): every rank gets here and
      // writes its own results, which must all equal one process's.
      std::ofstream out(out_dir + "/result" + std::to_string(own_rank()) + ".txt");
      out.precision(17);
      val = make_data(97, 2);
      tl::TrainLoop<Mlp, tl::gpu_mode::DistributedDataParallel> loop(net, train, {}, optimizer,
                                                                     torch::nn::CrossEntropyLoss(), options, mode);
      if (scenario == "evaluate_everywhere") {
        write_eval(out, "before", loop.evaluate(val));
        torch::save(loop.predict(val), out_dir + "/predict_before" + std::to_string(own_rank()) + ".pt");
        loop.fit(1);
        write_eval(out, "between", loop.evaluate(val));
        loop.fit(1);
        write_eval(out, "after", loop.evaluate(val));
        torch::save(loop.predict(val), out_dir + "/predict_after" + std::to_string(own_rank()) + ".pt");
      } else {
        loop.fit(1);  // a warm-up loop, still alive while the second one trains
        torch::optim::SGD second_optimizer(net->parameters(), torch::optim::SGDOptions(0.02));
        tl::TrainLoop<Mlp, tl::gpu_mode::DistributedDataParallel> second(
            net, train, {}, second_optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions(options).clip_grad_norm(0.5),
            mode);
        second.fit(1);
        loop.fit(1);  // and the first one again
      }
      std::vector<torch::Tensor> params;
      for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
      torch::save(params, out_dir + "/params" + std::to_string(own_rank()) + ".pt");
      return 0;
    }

    if (std::holds_alternative<tl::gpu_mode::Single>(chosen.get())) chosen = mode;
    tl::Criterion criterion = torch::nn::CrossEntropyLoss();
    if (scenario == "slow") {
      // test_stall_watchdog's stragglers: TL_TEST_SLOW=<rank>:<input|forward|backward>:<ms> sleeps that
      // long per micro-batch in that part of the step on that rank (none: a clean run);
      // TL_TEST_STEPS steps of one epoch.
      const std::string slow = std::getenv("TL_TEST_SLOW") ? std::getenv("TL_TEST_SLOW") : "";
      const int slow_rank = slow.empty() ? -1 : std::stoi(slow.substr(0, slow.find(':')));
      const std::string part = slow.empty() ? "" : slow.substr(slow.find(':') + 1, slow.rfind(':') - slow.find(':') - 1);
      const auto pause = std::chrono::milliseconds(slow.empty() ? 0 : std::stoi(slow.substr(slow.rfind(':') + 1)));
      const bool mine = slow_rank >= 0 && own_rank() == slow_rank;
      train = make_data(4 * total_world * env_number("TL_TEST_STEPS", 40), 1);
      callbacks.push_back(std::make_shared<StragglerLog>(out_dir));
      if (mine && part == "input") callbacks.push_back(std::make_shared<SleepBeforeForward>(pause));
      if (mine && part == "forward") {
        criterion = [pause](const torch::Tensor& output, const torch::Tensor& target) {
          std::this_thread::sleep_for(pause);
          return torch::nn::functional::cross_entropy(output, target);
        };
      }
      if (mine && part == "backward") {
        net->fc1->weight.register_hook([pause](torch::Tensor gradient) {
          std::this_thread::sleep_for(pause);
          return gradient;
        });
      }
    }
    tl::TrainLoop<Mlp, tl::gpu_mode::Any> loop(net, train, val, trained_optimizer, criterion, options, chosen);
    tl::EvalResult before;
    if (scenario == "lr_between_fits") before = loop.evaluate(val);
    if (scenario == "sync_bn") {  // test_recipe: BatchNorm over the global batch (TL_TEST_SYNC_BN=0: per rank)
      torch::manual_seed(5);
      BnMlp bn_net;
      torch::optim::SGD bn_optimizer(bn_net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      const int64_t n = env_number("TL_TEST_SAMPLES", 4 * total_world * 5);
      tl::TrainLoop<BnMlp, tl::gpu_mode::DistributedDataParallel> bn_loop(
          bn_net, make_data(n, 1), {}, bn_optimizer, torch::nn::CrossEntropyLoss(),
          tl::TrainLoopOptions().batch_size(4).shuffle(false).sync_batchnorm(env_number("TL_TEST_SYNC_BN", 1) != 0), mode);
      bn_loop.fit(1);
      if (tl::is_main_process()) torch::save(flat_state(*bn_net), out_dir + "/bn_state.pt");
      return 0;
    }
    if (scenario == "lr_find") {  // test_recipe: the sweep in spawned ranks; the caller's model untouched
      std::vector<torch::Tensor> start;
      for (const auto& p : net->parameters()) start.push_back(p.detach().clone());
      auto found = loop.lr_find(tl::LrFinderOptions().num_steps(20));
      double moved = 0;
      for (size_t i = 0; i < start.size(); ++i) moved = std::max(moved, (net->parameters()[i] - start[i]).abs().max().item<double>());
      if (tl::is_main_process()) {
        std::ofstream(out_dir + "/lr_find.txt") << found.learning_rates.size() << '\n' << found.valley << '\n' << moved << '\n';
      }
      return 0;
    }
    if (scenario == "sharded_model_changes") {  // test_sharding, in joined ranks: a sharded loop keeps its layout
      auto fsdp = tl::gpu_mode::FullyShardedDataParallel().processes_like(mode).sharding(tl::distributed::Sharding::Gradients);
      tl::TrainLoop<Mlp, tl::gpu_mode::FullyShardedDataParallel> sharded(net, train, {}, trained_optimizer,
                                                                         torch::nn::CrossEntropyLoss(), options, fsdp);
      sharded.fit(1);
      net->fc3 = net->replace_module("fc3", torch::nn::Linear(16, 3));  // new tensors under the old names
      sharded.fit(1);
      return 0;
    }
    auto history = loop.fit(epochs, callbacks, resume);
    int lowered = 0;
    if (scenario == "twofits" || scenario == "lr_between_fits") {
      // A second fit() continues from the first one's weights and optimizer state. The ranks of
      // this second launch pass the first fit() again, and get its History back.
      if (scenario == "lr_between_fits" && loop.evaluate(val).loss < before.loss) {
        for (auto& group : optimizer.param_groups()) {
          static_cast<torch::optim::SGDOptions&>(group.options()).lr(0.01).momentum(0.5);
        }
        lowered = 1;
      }
      history = loop.fit(epochs, callbacks);  // continues: epoch 2, and the History of both
    }

    // Only one process gets here per job: the launching one (or each rank, when joined by torchrun).
    std::vector<torch::Tensor> params;
    for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
    const char* joined_rank = std::getenv("RANK") ? std::getenv("RANK") : std::getenv("OMPI_COMM_WORLD_RANK");
    torch::save(params, out_dir + "/params" + (joined_rank ? std::string(joined_rank) : "") + ".pt");
    if (tl::is_main_process() && scenario == "stop_on_rank1") {
      std::ofstream(out_dir + "/result.txt") << "steps " << history.total_steps << "\nstop_reason_ok "
                                             << (history.stop_reason == "a callback on another rank asked to stop" ? 1 : 0)
                                             << "\n";
      return 0;
    }
    if (tl::is_main_process()) {
      // Evaluate the returned model in this one process: must equal the ranks' reduced values.
      tl::TrainLoop<Mlp> local(net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), options);
      auto check = local.evaluate(val);
      std::ofstream out(out_dir + "/result.txt");
      out.precision(17);
      out << "steps " << history.total_steps << "\nepochs " << history.epochs.size() << "\nval_loss "
          << history.last().validation->loss << "\nval_accuracy " << history.last().validation->metrics.at("accuracy")
          << "\nval_samples " << history.last().validation->samples << "\nlocal_val_loss " << check.loss
          << "\nlocal_val_accuracy " << check.metrics.at("accuracy") << "\ntrain_samples " << history.last().samples
          << "\nlowered " << lowered << "\nlr " << optimizer.param_groups()[0].options().get_lr()
          << "\nlast_epoch " << history.last().epoch << "\ncounted " << (counter ? counter->steps : -1)
          << "\noptimizer_state_bytes " << history.last().optimizer_state_bytes << "\noptimizer_state_bytes_total "
          << std::accumulate(history.last().optimizer_state_bytes_by_rank.begin(),
                             history.last().optimizer_state_bytes_by_rank.end(), int64_t{0})
          << "\noptimizer_state_ranks " << history.last().optimizer_state_bytes_by_rank.size()
          << "\nstragglers_named " << std::count_if(history.stragglers.begin(), history.stragglers.end(), [](const auto& r) { return !r.ended; })
          << "\nfirst_straggler_rank " << (history.stragglers.empty() ? -1 : history.stragglers.front().rank) << "\n";
      for (const auto& epoch : history.epochs) {  // every epoch's count and loss (test_elastic)
        out << "epoch" << epoch.epoch << "_samples " << epoch.samples << "\nepoch" << epoch.epoch << "_loss "
            << epoch.train_loss << "\nepoch" << epoch.epoch << "_accuracy " << epoch.train_metrics.at("accuracy") << "\n";
      }
    }
    return 0;
  } catch (const c10::OutOfMemoryError& e) {
    std::cerr << "C10_OUT_OF_MEMORY: " << e.what() << '\n';
    return 5;
  } catch (const c10::Error& e) {
    std::cerr << "C10_ERROR: " << e.what() << '\n';
    return 4;
  } catch (const tl::CheckpointError& e) {
    std::cerr << "CHECKPOINT_ERROR: " << e.what() << '\n';
    try {
      std::rethrow_if_nested(e);
    } catch (const tl::RankFailedError& nested) {
      std::cerr << "NESTED rank=" << nested.details().rank << " type=" << nested.details().error_type << '\n';
    }
    return 3;
  } catch (const tl::RankFailedError& e) {
    std::cerr << "ERROR: " << e.what() << "\nRANK_FAILED rank=" << e.details().rank << '\n';
    return 3;
  } catch (const tl::Error& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 3;
  }
}
