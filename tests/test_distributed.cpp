#define BOOST_TEST_MODULE test_distributed
#include "unit_test.hpp"

#include "ddp_test_model.hpp"
#include "small_tmpfs.hpp"
#include "test_support.hpp"

#include <trainloop/distributed/launch/free_port.hpp>

#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <iterator>
#include <thread>
#include <vector>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

namespace tl = trainloop;
namespace fs = std::filesystem;

struct WorkerRun {
  int exit_code = -1;
  std::string output;
  double seconds = 0;
  fs::path dir;
  std::map<std::string, double> result;
};

/// The collective timeout of ddp_worker's failure scenarios (throw, sigkill, segv, exit0). A job
/// that ends before it ended because the launcher saw the failure, not because a collective gave
/// up: the bound tells those two apart, it is not a speed goal.
constexpr double kFailureTimeoutSeconds = 60;

/// Runs ddp_worker (which spawns its ranks) and collects its output and result file.
WorkerRun run_worker(const std::string& scenario, int world, int port = 0, const std::string& env = "",
                     const std::string& name = "") {
  WorkerRun run;
  run.dir = fs::temp_directory_path() / ("trainloop_ddp_" + scenario + name + "_" + std::to_string(world) + "_" +
                                         std::to_string(::getpid()));
  fs::remove_all(run.dir);
  fs::create_directories(run.dir / "tmp");
  // The job's temporary files (run directories, kept error texts) go where the test removes them.
  const std::string tmpdir = env.find("TMPDIR=") == std::string::npos ? "TMPDIR=" + (run.dir / "tmp").string() : "";
  std::string command = tmpdir + " " + env + " " + DDP_WORKER_PATH + " " + scenario + " " + std::to_string(world) + " " +
                        run.dir.string() + " " + std::to_string(port) + " 2>&1";
  auto start = std::chrono::steady_clock::now();
  FILE* pipe = ::popen(command.c_str(), "r");
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) run.output.append(buffer.data(), n);
  int status = ::pclose(pipe);
  run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(run.dir / "result.txt");
  std::string key;
  double value;
  while (in >> key >> value) run.result[key] = value;
  return run;
}

/// Processes still running this worker binary (none may outlive a job).
int leftover_workers() { return processes_running("ddp_worker"); }

BOOST_AUTO_TEST_CASE(ddp_matches_one_process_with_the_combined_batch) {
  for (int world : {2, 3}) {
    auto run = run_worker("train", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(world, 1)).abs().max().item<double>();
    BOOST_TEST_MESSAGE("world " << world << ": max |ddp - single| = " << difference);
    BOOST_TEST(difference <= 1e-5);
    BOOST_TEST(run.result["steps"] == 5);
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(ddp_with_gradient_accumulation_matches_one_process) {
  for (int world : {2, 3}) {
    auto run = run_worker("accumulate", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(world, 2)).abs().max().item<double>();
    BOOST_TEST_MESSAGE("world " << world << " accumulation 2: max |ddp - single| = " << difference);
    BOOST_TEST(difference <= 1e-5);
    BOOST_TEST(run.result["steps"] == 5);
    fs::remove_all(run.dir);
  }
}

// N = 37 samples, batch 4 per rank: the last combined batch holds 5 samples on 2 ranks (3 + 2)
// and 1 on 3 ranks (1 + 0 + 0: two ranks join the reduction without samples).
BOOST_AUTO_TEST_CASE(ddp_equals_one_process_after_every_epoch_when_the_last_batches_are_uneven) {
  for (int64_t accumulation : {1, 2}) {
    for (int world : {2, 3}) {
      const std::string env = "TL_TEST_ACCUMULATION=" + std::to_string(accumulation);
      auto run = run_worker("uneven", world, 0, env, "_acc" + std::to_string(accumulation));
      BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
      const auto reference = uneven_reference(world, accumulation, (run.dir / "tmp").string());
      for (int64_t e = 1; e <= kUnevenEpochs; ++e) {
        const auto ddp = load_params((run.dir / ("params_epoch" + std::to_string(e) + ".pt")).string());
        const double difference = (ddp - reference[static_cast<size_t>(e - 1)]).abs().max().item<double>();
        BOOST_TEST_MESSAGE("world " << world << " accumulation " << accumulation << " epoch " << e
                                    << ": max |ddp - single| = " << difference);
        BOOST_TEST(difference <= 1e-6);
      }
      BOOST_TEST(run.result["train_samples"] == kUnevenSamples);  // every sample once, none repeated
      fs::remove_all(run.dir);
    }
  }
  // The check can fail: PyTorch's way (padded shards, ranks weighted equally) differs from one process.
  auto padded = run_worker("uneven", 3, 0, "TL_TEST_EXACT=0", "_padded");
  BOOST_REQUIRE_MESSAGE(padded.exit_code == 0, padded.output);
  const auto reference = uneven_reference(3, 1, (padded.dir / "tmp").string());
  const double difference =
      (load_params((padded.dir / "params_epoch1.pt").string()) - reference[0]).abs().max().item<double>();
  BOOST_TEST_MESSAGE("padded shards, world 3, epoch 1: max |ddp - single| = " << difference);
  BOOST_TEST(difference > 1e-4);
  BOOST_TEST(padded.result["train_samples"] == 39);  // 37 padded to 3 x 13
  fs::remove_all(padded.dir);
}

BOOST_AUTO_TEST_CASE(a_second_fit_continues_from_the_first) {
  auto run = run_worker("twofits", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(2, 1, 2)).abs().max().item<double>();
  BOOST_TEST_MESSAGE("two fits: max |ddp - single| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  BOOST_TEST(run.result["steps"] == 10);
  BOOST_TEST(run.result["epochs"] == 2);      // the History of both fits
  BOOST_TEST(run.result["last_epoch"] == 2);  // the second fit trained epoch 2, not epoch 1 again
  // The caller's callback object holds rank 0's state: it counted the steps of both fits.
  BOOST_TEST(run.result["counted"] == 10);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(validation_counts_every_sample_once) {
  for (const std::string scenario : {"eval97", "eval99"}) {
    for (int world : {2, 3}) {
      auto run = run_worker(scenario, world);
      BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
      const double n = scenario == "eval97" ? 97 : 99;
      BOOST_TEST_MESSAGE(scenario << " world " << world << ": val loss " << run.result["val_loss"] << " vs "
                                  << run.result["local_val_loss"]);
      BOOST_TEST(run.result["val_samples"] == n);
      BOOST_TEST(std::abs(run.result["val_loss"] - run.result["local_val_loss"]) <= 1e-6);
      BOOST_TEST(std::abs(run.result["val_accuracy"] - run.result["local_val_accuracy"]) <= 1e-6);
      // Exact uneven batches: training shards are not padded, every sample counts once.
      BOOST_TEST(run.result["train_samples"] == n);
      fs::remove_all(run.dir);
    }
  }
}

BOOST_AUTO_TEST_CASE(a_rank_that_throws_ends_the_job_with_its_error) {
  auto run = run_worker("throw", 3);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.seconds < kFailureTimeoutSeconds);  // see kFailureTimeoutSeconds
  BOOST_TEST(run.output.find("rank 1") != std::string::npos);
  BOOST_TEST(run.output.find("rank one gave up in epoch 2") != std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_rank_killed_mid_epoch_ends_the_job) {
  auto run = run_worker("sigkill", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.seconds < kFailureTimeoutSeconds);  // see kFailureTimeoutSeconds
  BOOST_TEST(run.output.find("rank 1") != std::string::npos);
  BOOST_TEST(run.output.find("SIGKILL") != std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_master_port_in_use_is_a_clear_error) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  BOOST_REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
  BOOST_REQUIRE(::listen(fd, 1) == 0);
  socklen_t length = sizeof address;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  const int port = ntohs(address.sin_port);
  auto run = run_worker("train", 2, port);
  ::close(fd);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.output.find(std::to_string(port)) != std::string::npos);
  // Found at once (the launcher's check, or the store failing to listen): "already in use" is
  // never the text of a timeout, so the job did not wait for one.
  BOOST_TEST(run.output.find("already in use") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(ranks_started_by_hand_with_torchrun_variables_join_the_job) {
  // Two processes started the way torchrun starts them; each one's fit() returns.
  const int port = tl::distributed::find_free_port();
  auto dir = fs::temp_directory_path() / ("trainloop_ddp_join_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::string common = "WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  std::string command = "(" + common + "RANK=0 LOCAL_RANK=0 " + DDP_WORKER_PATH + " train 2 " + dir.string() + " & " +
                        common + "RANK=1 LOCAL_RANK=1 " + DDP_WORKER_PATH + " train 2 " + dir.string() +
                        "; wait) 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  ::pclose(pipe);
  BOOST_TEST_MESSAGE(output);
  BOOST_REQUIRE(fs::exists(dir / "params0.pt"));
  BOOST_REQUIRE(fs::exists(dir / "params1.pt"));
  auto rank0 = load_params((dir / "params0.pt").string());
  auto rank1 = load_params((dir / "params1.pt").string());
  BOOST_TEST(torch::equal(rank0, rank1));  // every rank holds the same model
  BOOST_TEST((rank0 - reference_params(2, 1)).abs().max().item<double>() <= 1e-5);
  BOOST_TEST(fs::exists(dir / "result.txt"));  // written by rank 0, the main process under torchrun
  fs::remove_all(dir);
}

// ---- Same numbers in every launch path -------------------------------------------------------

namespace {

/// Runs `DDP_WORKER_PATH scenario` as `world` ranks started by hand with torchrun's variables;
/// returns the combined output once all ended.
std::string run_torchrun_style(const std::string& scenario, int world, const fs::path& dir, const std::string& env = "") {
  const int port = tl::distributed::find_free_port();
  std::string common = env + " WORLD_SIZE=" + std::to_string(world) + " LOCAL_WORLD_SIZE=" + std::to_string(world) +
                       " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
  std::string command = "(";
  for (int rank = 0; rank < world; ++rank) {
    command += common + "RANK=" + std::to_string(rank) + " LOCAL_RANK=" + std::to_string(rank) + " " + DDP_WORKER_PATH +
               " " + scenario + " " + std::to_string(world) + " " + dir.string() + (rank + 1 < world ? " & " : "; wait");
  }
  command += ") 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  ::pclose(pipe);
  return output;
}

std::map<std::string, double> read_result(const fs::path& path) {
  std::map<std::string, double> result;
  std::ifstream in(path);
  std::string key;
  double value;
  while (in >> key >> value) result[key] = value;
  return result;
}

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("trainloop_ddp_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

/// One process doing what ddp_worker's scenario does with `world` ranks of batch 4.
struct OneProcess {
  Mlp net;
  torch::optim::SGD optimizer;
  tl::TrainLoopOptions options;
  explicit OneProcess(int world)
      : net((torch::manual_seed(5), Mlp())),
        optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        options(tl::TrainLoopOptions().batch_size(4 * world).shuffle(false).metrics({std::make_shared<tl::Accuracy>()})) {}
  tl::TrainLoop<Mlp> loop(int world) { return {net, make_data(4 * world * 5, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options}; }
};

}  // namespace

BOOST_AUTO_TEST_CASE(evaluate_and_predict_give_every_rank_the_whole_dataset_before_between_and_after_fits) {
  // Under torchrun: before the first fit the engine was never prepared, so each rank used to
  // report its own shard (rank 0: n=49, rank 1: n=48).
  const int world = 2;
  auto dir = fresh_dir("evaluate_everywhere");
  auto output = run_torchrun_style("evaluate_everywhere", world, dir);
  BOOST_TEST_MESSAGE(output);

  OneProcess reference(world);
  auto loop = reference.loop(world);
  const auto val = make_data(97, 2);
  std::map<std::string, tl::EvalResult> expected;
  expected["before"] = loop.evaluate(val);
  const auto predict_before = loop.predict(val);
  loop.fit(1);
  expected["between"] = loop.evaluate(val);
  loop.fit(1);
  expected["after"] = loop.evaluate(val);
  const auto predict_after = loop.predict(val);

  for (int rank = 0; rank < world; ++rank) {
    auto result = read_result(dir / ("result" + std::to_string(rank) + ".txt"));
    for (const auto& [when, reference_result] : expected) {
      BOOST_TEST_MESSAGE("rank " << rank << " " << when << ": n=" << result[when + "_samples"] << " loss "
                                 << result[when + "_loss"] << " vs one process " << reference_result.loss);
      BOOST_TEST(result[when + "_samples"] == 97);
      BOOST_TEST(std::abs(result[when + "_loss"] - reference_result.loss) <= 1e-6);
      BOOST_TEST(std::abs(result[when + "_accuracy"] - reference_result.metrics.at("accuracy")) <= 1e-9);
    }
    for (const auto& [name, reference_outputs] :
         {std::pair{std::string("predict_before"), predict_before}, std::pair{std::string("predict_after"), predict_after}}) {
      torch::Tensor outputs;
      torch::load(outputs, (dir / (name + std::to_string(rank) + ".pt")).string());
      BOOST_TEST(outputs.sizes() == reference_outputs.sizes());
      BOOST_TEST((outputs - reference_outputs).abs().max().item<double>() <= 1e-5);
    }
  }
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(two_train_loops_over_one_model_under_torchrun_match_one_process) {
  // The first loop's gradient hooks used to outlive its fit: the second loop's fit threw "the
  // gradient of parameter #5 became ready twice in one step".
  const int world = 2;
  auto dir = fresh_dir("two_loops");
  auto output = run_torchrun_style("two_loops", world, dir);
  BOOST_TEST_MESSAGE(output);
  BOOST_TEST(output.find("became ready twice") == std::string::npos);

  OneProcess reference(world);
  auto first = reference.loop(world);
  first.fit(1);
  torch::optim::SGD second_optimizer(reference.net->parameters(), torch::optim::SGDOptions(0.02));
  tl::TrainLoop<Mlp> second(reference.net, make_data(4 * world * 5, 1), {}, second_optimizer,
                            torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions(reference.options).clip_grad_norm(0.5));
  second.fit(1);
  first.fit(1);
  const auto expected = flat_params(reference.net->parameters());
  for (int rank = 0; rank < world; ++rank) {
    const auto path = dir / ("params" + std::to_string(rank) + ".pt");
    BOOST_REQUIRE_MESSAGE(fs::exists(path), "rank " << rank << " did not finish");
    const double difference = (load_params(path.string()) - expected).abs().max().item<double>();
    BOOST_TEST_MESSAGE("rank " << rank << ": max |ddp - one process| = " << difference);
    BOOST_TEST(difference <= 1e-5);
  }
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(code_between_spawned_fits_sees_the_trained_model_and_the_new_optimizer_options) {
  // The program lowers the lr (and momentum) when evaluate() improved after the first fit. The
  // ranks used to train the second fit with the old options (libtorch 1.13's Optimizer::load
  // drops param-group options): max |param diff| 0.31 against one process.
  auto run = run_worker("lr_between_fits", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.result["lowered"] == 1);
  BOOST_TEST(std::abs(run.result["lr"] - 0.01) <= 1e-12);

  OneProcess reference(2);
  tl::TrainLoop<Mlp> loop(reference.net, make_data(40, 1), make_data(40, 2), reference.optimizer,
                          torch::nn::CrossEntropyLoss(), reference.options);
  const auto before = loop.evaluate(make_data(40, 2));
  loop.fit(1);
  BOOST_REQUIRE(loop.evaluate(make_data(40, 2)).loss < before.loss);
  for (auto& group : reference.optimizer.param_groups()) {
    static_cast<torch::optim::SGDOptions&>(group.options()).lr(0.01).momentum(0.5);
  }
  loop.fit(1);
  const double difference =
      (load_params((run.dir / "params.pt").string()) - flat_params(reference.net->parameters())).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |spawned ddp - one process| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  fs::remove_all(run.dir);
}

// ---- Failures end cleanly, and say what happened ---------------------------------------------

namespace {

/// Whether process `pid` is gone (or a zombie nobody reaped yet, which runs no code).
bool process_ended(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const auto state = text.find(") ");
  return state != std::string::npos && (text[state + 2] == 'Z' || text[state + 2] == 'X');
}

/// The trainloop-* entries in `dir` (run and session directories, kept error files).
std::vector<std::string> trainloop_entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().filename().string().rfind("trainloop-", 0) == 0) names.push_back(entry.path().filename());
  }
  return names;
}

}  // namespace

BOOST_AUTO_TEST_CASE(killing_the_launcher_takes_every_rank_with_it_and_its_directory_is_cleaned_later) {
  auto dir = fresh_dir("kill_launcher");
  auto tmp = dir / "tmp";
  fs::create_directories(tmp);
  const std::string tmp_env = "TMPDIR=" + tmp.string();
  const std::string path = DDP_WORKER_PATH;
  std::vector<std::string> args{path, "long", "2", dir.string()};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<std::string> env_strings{tmp_env, "PATH=/usr/bin:/bin"};
  std::vector<char*> envp;
  for (auto& e : env_strings) envp.push_back(e.data());
  envp.push_back(nullptr);
  pid_t launcher = 0;
  BOOST_REQUIRE(::posix_spawn(&launcher, path.c_str(), nullptr, nullptr, argv.data(), envp.data()) == 0);

  std::vector<pid_t> ranks;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (ranks.size() < 2 && std::chrono::steady_clock::now() < deadline) {
    ranks.clear();
    for (int rank = 0; rank < 2; ++rank) {
      std::ifstream in(dir / ("rank" + std::to_string(rank) + ".pid"));
      pid_t pid = 0;
      if (in >> pid) ranks.push_back(pid);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  BOOST_REQUIRE_MESSAGE(ranks.size() == 2, "the ranks never started training");
  BOOST_TEST(trainloop_entries(tmp).size() == 1u);  // the launcher's session directory

  ::kill(launcher, SIGKILL);  // no chance to clean up, as with the OOM killer
  ::waitpid(launcher, nullptr, 0);
  const auto killed = std::chrono::steady_clock::now();
  bool all_ended = false;
  // PR_SET_PDEATHSIG ends them at once; the 60 s only bound a hang (not a speed goal).
  while (!all_ended && std::chrono::steady_clock::now() - killed < std::chrono::seconds(60)) {
    all_ended = process_ended(ranks[0]) && process_ended(ranks[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  BOOST_TEST_MESSAGE("ranks ended " << std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count()
                                    << " s after the launcher was killed");
  BOOST_TEST(all_ended);
  if (!all_ended) {
    for (pid_t pid : ranks) ::kill(pid, SIGKILL);
  }
  BOOST_TEST(trainloop_entries(tmp).size() == 1u);  // left behind: nobody could remove it

  // The next launcher (here: a short job) removes what the dead one left.
  auto next = run_worker("train", 2, 0, tmp_env);
  BOOST_REQUIRE_MESSAGE(next.exit_code == 0, next.output);
  BOOST_TEST(trainloop_entries(tmp).empty());
  fs::remove_all(next.dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_rank_error_deep_in_libtorch_reaches_the_user_in_its_own_words_and_type) {
  auto run = run_worker("bad_label", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 4);  // caught as c10::Error in the caller
  // The message leads with the rank and its error, not with the tail of a backtrace.
  const auto lead = run.output.find("rank 1 failed: ");
  BOOST_REQUIRE(lead != std::string::npos);
  const auto target = run.output.find("Target 7 is out of bounds");
  BOOST_TEST(target != std::string::npos);
  BOOST_TEST(target > lead);
  BOOST_TEST(target - lead < 200);
  // The rank printed it on its own stderr too, and the complete text (backtrace) is in a file
  // the message names.
  BOOST_TEST(run.output.find("trainloop: rank 1 failed: ") != std::string::npos);
  const std::string marker = "its complete error with backtrace: ";
  const auto at = run.output.find(marker);
  BOOST_REQUIRE(at != std::string::npos);
  const std::string file = run.output.substr(at + marker.size(), run.output.find('\n', at) - at - marker.size());
  std::ifstream full(file);
  std::string text((std::istreambuf_iterator<char>(full)), std::istreambuf_iterator<char>());
  BOOST_TEST(text.find("Target 7 is out of bounds") != std::string::npos);
  BOOST_TEST(text.find("frame #") != std::string::npos);  // libtorch's backtrace
  fs::remove(file);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_crashed_rank_is_named_not_the_peer_that_lost_it) {
  for (int repetition = 0; repetition < 3; ++repetition) {
    auto run = run_worker("segv", 2);
    BOOST_TEST_MESSAGE(run.output);
    BOOST_TEST(run.exit_code == 3);
    BOOST_TEST(run.output.find("RANK_FAILED rank=1") != std::string::npos);
    BOOST_TEST(run.output.find("SIGSEGV") != std::string::npos);
    BOOST_TEST(leftover_workers() == 0);
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(a_rank_that_exits_0_mid_training_is_named_as_such) {
  auto run = run_worker("exit0", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.output.find("RANK_FAILED rank=1") != std::string::npos);
  BOOST_TEST(run.output.find("exited with status 0 before its work was done") != std::string::npos);
  BOOST_TEST(run.seconds < kFailureTimeoutSeconds);  // see kFailureTimeoutSeconds
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(an_out_of_memory_error_in_a_rank_is_caught_as_c10_out_of_memory_by_the_caller) {
  auto run = run_worker("oom", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 5);
  BOOST_TEST(run.output.find("simulated: CUDA out of memory on rank 1") != std::string::npos);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_checkpoint_error_in_a_rank_is_caught_as_checkpoint_error_with_the_rank_failure_nested) {
  auto run = run_worker("checkpoint_error", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  // caught as trainloop::CheckpointError, not as RankFailedError
  BOOST_TEST(run.output.find("CHECKPOINT_ERROR: ") != std::string::npos);
  BOOST_TEST(run.output.find("RANK_FAILED") == std::string::npos);
  BOOST_TEST(run.output.find("epoch3.ckpt is truncated") != std::string::npos);
  BOOST_TEST(run.output.find("NESTED rank=1 type=trainloop::CheckpointError") != std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_caller_that_retries_a_failed_fit_with_a_smaller_batch_gets_the_same_path_in_every_rank) {
  // The ranks of the retry pass the failed fit() again: it must throw there too, or they would
  // skip the caller's catch block and never reach the retry.
  auto run = run_worker("retry_after_oom", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.result["retried"] == 1);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(an_exception_escaping_main_in_a_rank_reaches_the_user_in_its_own_words) {
  auto run = run_worker("throw_before_fit", 2);
  BOOST_TEST_MESSAGE(run.output);
  BOOST_TEST(run.exit_code == 3);
  BOOST_TEST(run.output.find("rank 1 failed: rank 1 could not open its shard of the data") != std::string::npos);
  BOOST_TEST(run.output.find("SIGABRT") == std::string::npos);
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_program_whose_sigchld_handler_reaps_every_child_still_runs_ddp) {
  auto run = run_worker("sigchld_handler", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(2, 1)).abs().max().item<double>();
  BOOST_TEST(difference <= 1e-5);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_program_that_ignores_sigchld_still_runs_ddp) {
  // With SIGCHLD ignored the kernel reaps the ranks itself; a successful job used to fail with
  // "reaped by someone else".
  auto run = run_worker("sigchld_ignored", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  auto difference = (load_params((run.dir / "params.pt").string()) - reference_params(2, 1)).abs().max().item<double>();
  BOOST_TEST(difference <= 1e-5);
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(a_timeout_of_zero_is_rejected_before_any_rank_starts) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05));
  std::string message;
  try {
    tl::TrainLoop<Mlp, tl::gpu_mode::DistributedDataParallel> loop(
        net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions(),
        tl::gpu_mode::DistributedDataParallel().device_type(torch::kCPU).timeout(std::chrono::milliseconds(0)));
    loop.fit(1);
  } catch (const tl::ConfigurationError& error) {
    message = error.what();
  }
  BOOST_TEST(message.find("timeout is 0 ms") != std::string::npos, message);
  BOOST_TEST(leftover_workers() == 0);
}

BOOST_AUTO_TEST_CASE(a_stop_requested_on_one_rank_stops_every_rank_after_that_step) {
  auto run = run_worker("stop_on_rank1", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  BOOST_TEST(run.result["steps"] == 3);
  BOOST_TEST(run.result["stop_reason_ok"] == 1);  // rank 0 reports that another rank asked
  fs::remove_all(run.dir);
}

// ---- Checkpoints, resume and restarts under DDP -----------------------------------------------

namespace {

/// ddp_worker's "ckpt" scenario with checkpoints in `ckpt_dir` and the given TL_TEST_* settings.
WorkerRun run_ckpt(const std::string& name, const fs::path& ckpt_dir, const std::string& settings) {
  return run_worker("ckpt", 2, 0, "TL_TEST_CKPT_DIR=" + ckpt_dir.string() + " " + settings, "_" + name);
}

/// One process with batch 8 and shuffling: what the "ckpt" scenario's 2 ranks of batch 4 do.
struct ShuffledReference {
  Mlp net;
  torch::optim::SGD optimizer;
  tl::TrainLoop<Mlp> loop;
  ShuffledReference()
      : net((torch::manual_seed(5), Mlp())),
        optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)),
        loop(net, make_data(40, 1), make_data(40, 2), optimizer, torch::nn::CrossEntropyLoss(),
             tl::TrainLoopOptions().batch_size(8).metrics({std::make_shared<tl::Accuracy>()})) {}
};

}  // namespace

BOOST_AUTO_TEST_CASE(ddp_k_epochs_then_resume_then_k_epochs_equals_2k_bit_for_bit) {
  auto dir = fresh_dir("ckpt_resume");
  auto full = run_ckpt("full", dir / "full", "TL_TEST_EPOCHS=4");
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  auto first = run_ckpt("first", dir / "split", "TL_TEST_EPOCHS=2");
  BOOST_REQUIRE_MESSAGE(first.exit_code == 0, first.output);
  auto second = run_ckpt("second", dir / "split", "TL_TEST_EPOCHS=2 TL_TEST_RESUME=last");
  BOOST_REQUIRE_MESSAGE(second.exit_code == 0, second.output);
  BOOST_TEST(torch::equal(load_params((second.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
  BOOST_TEST(second.result["epochs"] == 4);
  BOOST_TEST(second.result["val_loss"] == full.result["val_loss"]);
  for (auto* run : {&full, &first, &second}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(spawned_ranks_start_from_the_callers_weights_also_when_a_resume_finds_nothing) {
  // Rank 1 builds its model from another seed than the caller. A spawned rank does not broadcast:
  // it loads the caller's state (initial.ckpt) when fit() resumes nothing, also when its resume
  // ("last") finds no checkpoint yet. If it kept its own weights, the ranks would train apart
  // from step 1.
  auto dir = fresh_dir("ckpt_fallback");
  auto same = run_ckpt("same", dir / "same", "TL_TEST_EPOCHS=1");
  BOOST_REQUIRE_MESSAGE(same.exit_code == 0, same.output);
  auto fresh = run_ckpt("fresh", dir / "fresh", "TL_TEST_EPOCHS=1 TL_TEST_SEED_BY_RANK=1");
  BOOST_REQUIRE_MESSAGE(fresh.exit_code == 0, fresh.output);
  auto resumed_nothing = run_ckpt("nothing", dir / "nothing", "TL_TEST_EPOCHS=1 TL_TEST_SEED_BY_RANK=1 TL_TEST_RESUME=last");
  BOOST_REQUIRE_MESSAGE(resumed_nothing.exit_code == 0, resumed_nothing.output);
  BOOST_TEST(resumed_nothing.output.find("yet; training from the start") != std::string::npos);
  const torch::Tensor expected = load_params((same.dir / "params.pt").string());
  BOOST_TEST(torch::equal(load_params((fresh.dir / "params.pt").string()), expected));
  BOOST_TEST(torch::equal(load_params((resumed_nothing.dir / "params.pt").string()), expected));
  for (auto* run : {&same, &fresh, &resumed_nothing}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_resume_whose_every_checkpoint_is_unreadable_fails_and_overwrites_nothing) {
  // "last" with checkpoints in the directory, none readable: as in single and dp, fit() throws the
  // CheckpointError — it must not train from the caller's weights and then write new checkpoints
  // over the files it could not read (once the spawned ranks' initial.ckpt fallback did both).
  auto dir = fresh_dir("ckpt_unreadable");
  fs::create_directories(dir / "bad");
  std::ofstream(dir / "bad" / "last.ckpt") << "not a checkpoint";
  std::ofstream(dir / "bad" / "epoch1.ckpt") << "not one either";
  auto run = run_ckpt("bad", dir / "bad", "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
  BOOST_TEST(run.exit_code == 3, run.output);
  BOOST_TEST(run.output.find("CHECKPOINT_ERROR") != std::string::npos, run.output);
  BOOST_TEST(run.output.find("last.ckpt") != std::string::npos, run.output);
  BOOST_TEST(!fs::exists(run.dir / "params.pt"), "no trained model was handed back");
  auto text_of = [](const fs::path& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  BOOST_TEST(text_of(dir / "bad" / "last.ckpt") == "not a checkpoint");
  BOOST_TEST(text_of(dir / "bad" / "epoch1.ckpt") == "not one either");
  std::vector<std::string> files;
  for (const auto& entry : fs::directory_iterator(dir / "bad")) files.push_back(entry.path().filename().string());
  BOOST_TEST(files.size() == 2u, "files in the checkpoint directory afterwards: " << files.size());
  fs::remove_all(run.dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_rank_killed_mid_training_restarts_from_the_newest_checkpoint_and_ends_as_if_uninterrupted) {
  auto dir = fresh_dir("ckpt_restart");
  auto full = run_ckpt("full", dir / "full", "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2");
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  // 5 steps per epoch: step 7 is inside epoch 2, the newest checkpoint before it is step 6.
  auto killed = run_ckpt("killed", dir / "killed",
                         "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_KILL_AT_STEP=7 TL_TEST_MAX_RESTARTS=1");
  BOOST_TEST_MESSAGE(killed.output);
  BOOST_REQUIRE_MESSAGE(killed.exit_code == 0, killed.output);
  BOOST_TEST(killed.output.find("restarting all ranks from the newest checkpoint (restart 1 of at most 1)") != std::string::npos);
  BOOST_TEST(killed.output.find("resumed from") != std::string::npos);
  BOOST_TEST(torch::equal(load_params((killed.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
  BOOST_TEST(killed.result["epochs"] == 3);
  BOOST_TEST(leftover_workers() == 0);
  // Without a restart left, the same failure ends the job.
  auto no_restart = run_ckpt("no_restart", dir / "no_restart", "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_KILL_AT_STEP=7");
  BOOST_TEST(no_restart.exit_code == 3);
  BOOST_TEST(no_restart.output.find("RANK_FAILED rank=1") != std::string::npos);
  for (auto* run : {&full, &killed, &no_restart}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(torchrun_restarted_ranks_resume_from_last_by_themselves) {
  auto dir = fresh_dir("ckpt_torchrun");
  auto reference_dir = dir / "reference";
  fs::create_directories(reference_dir);
  const std::string common = "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_CKPT_DIR=" + (dir / "ckpt").string() + " ";
  // First attempt: rank 1 is killed at step 7; rank 0 fails as its peer vanished.
  auto first = run_torchrun_style("ckpt", 2, dir, common + "TL_TEST_KILL_AT_STEP=7 TORCHELASTIC_RESTART_COUNT=0");
  BOOST_TEST_MESSAGE(first);
  BOOST_REQUIRE(fs::exists(dir / "ckpt" / "last.ckpt"));
  fs::remove(dir / "params0.pt");
  // torchrun's restart: the same command with TORCHELASTIC_RESTART_COUNT=1 and nothing else.
  auto second = run_torchrun_style("ckpt", 2, dir, common + "TORCHELASTIC_RESTART_COUNT=1");
  BOOST_TEST_MESSAGE(second);
  BOOST_REQUIRE(fs::exists(dir / "params0.pt"));
  auto uninterrupted = run_torchrun_style("ckpt", 2, reference_dir,
                                          "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_CKPT_DIR=" + (dir / "ckpt_ref").string());
  BOOST_TEST(torch::equal(load_params((dir / "params0.pt").string()), load_params((reference_dir / "params0.pt").string())));
  BOOST_TEST(torch::equal(load_params((dir / "params1.pt").string()), load_params((dir / "params0.pt").string())));
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_ddp_checkpoint_resumes_in_one_process_and_the_other_way) {
  auto dir = fresh_dir("ckpt_cross");
  // The same training as one process with batch 8 (2 ranks x 4 see the same samples per step).
  ShuffledReference reference;
  reference.loop.fit(2);
  const auto expected = flat_params(reference.net->parameters());

  // DDP writes after epoch 1; one process resumes and trains epoch 2.
  auto ddp = run_ckpt("ddp", dir / "from_ddp", "TL_TEST_EPOCHS=1");
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  ShuffledReference single_resumed;
  single_resumed.loop.fit(1, {std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir / "from_ddp"))}, "last");
  const double ddp_to_single = (flat_params(single_resumed.net->parameters()) - expected).abs().max().item<double>();
  BOOST_TEST_MESSAGE("ddp checkpoint resumed in one process: max |diff| = " << ddp_to_single);
  BOOST_TEST(ddp_to_single <= 1e-5);
  BOOST_TEST(single_resumed.loop.history().epochs.size() == 2u);

  // One process writes after epoch 1; DDP resumes and trains epoch 2.
  ShuffledReference single;
  single.loop.fit(1, {std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir / "from_single"))});
  auto resumed = run_ckpt("resumed", dir / "from_single", "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
  BOOST_REQUIRE_MESSAGE(resumed.exit_code == 0, resumed.output);
  const double single_to_ddp = (load_params((resumed.dir / "params.pt").string()) - expected).abs().max().item<double>();
  BOOST_TEST_MESSAGE("one-process checkpoint resumed by DDP: max |diff| = " << single_to_ddp);
  BOOST_TEST(single_to_ddp <= 1e-5);
  BOOST_TEST(resumed.result["epochs"] == 2);
  for (auto* run : {&ddp, &resumed}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(a_full_disk_stops_every_rank_with_an_error_naming_the_file, *boost::unit_test::precondition(can_mount_tmpfs)) {
  auto dir = fresh_dir("ckpt_full");
  // The size of one checkpoint of this job (2 ranks x batch 4, 40 samples: 5 steps per epoch).
  auto probe = run_ckpt("probe", dir / "probe", "TL_TEST_EPOCHS=1");
  BOOST_REQUIRE_MESSAGE(probe.exit_code == 0, probe.output);
  const uintmax_t pages = (fs::file_size(dir / "probe" / "epoch=0001-step=000005.ckpt") + 4095) / 4096;
  {
    SmallTmpfs disk((2 * pages + pages / 2) * 4096);  // room for two checkpoints, not three
    BOOST_REQUIRE(disk.mounted);
    auto full = run_ckpt("full", disk.dir.path, "TL_TEST_EPOCHS=3");
    BOOST_TEST_MESSAGE(full.output);
    BOOST_TEST(full.exit_code == 3);  // a trainloop error, not an abort
    BOOST_TEST(full.output.find("CHECKPOINT_ERROR: ") != std::string::npos);  // caught as CheckpointError
    const std::string third = (disk.dir.path / "epoch=0003-step=000015.ckpt").string();
    BOOST_TEST(full.output.find("cannot write the checkpoint " + third) != std::string::npos, full.output);
    BOOST_TEST(full.output.find("No space left on device") != std::string::npos, full.output);
    BOOST_TEST(full.output.find("terminate called") == std::string::npos, full.output);
    BOOST_TEST(leftover_workers() == 0);
    std::vector<std::string> names;
    for (const auto& entry : fs::directory_iterator(disk.dir.path)) names.push_back(entry.path().filename().string());
    std::sort(names.begin(), names.end());
    BOOST_TEST(names == (std::vector<std::string>{"epoch=0001-step=000005.ckpt", "epoch=0002-step=000010.ckpt", "last.ckpt"}),
               boost::test_tools::per_element());
    ShuffledReference reader;
    reader.loop.load_checkpoint(disk.dir.path / "last.ckpt");
    BOOST_TEST(reader.loop.history().epochs.size() == 2u);
    fs::remove_all(full.dir);
  }
  fs::remove_all(probe.dir);
  fs::remove_all(dir);
}

// ---- ZeRO-1: the optimizer state sharded over the ranks (distributed/zero/zero_optimizer_shard.hpp) ----

namespace {

/// Adam's two moments of every parameter a checkpoint holds state for, in parameter order and
/// flattened, and how many parameters have state.
std::pair<torch::Tensor, int64_t> adam_moments(const fs::path& file) {
  torch::serialize::InputArchive archive, ours, optimizer, groups, group, states;
  archive.load_from(file.string());
  BOOST_REQUIRE(archive.try_read("__trainloop__", ours) && ours.try_read("optimizer", optimizer));
  BOOST_REQUIRE(optimizer.try_read("param_groups", groups) && groups.try_read("param_groups/0", group));
  BOOST_REQUIRE(optimizer.try_read("state", states));
  torch::Tensor size;
  BOOST_REQUIRE(group.try_read("params/size", size));
  std::vector<torch::Tensor> moments;
  int64_t with_state = 0;
  for (int64_t i = 0; i < size.item<int64_t>(); ++i) {
    c10::IValue key;
    torch::serialize::InputArchive state;
    if (!group.try_read("params/" + std::to_string(i), key) || !states.try_read(key.toStringRef(), state)) continue;
    ++with_state;
    torch::Tensor exp_avg, exp_avg_sq;
    state.read("exp_avg", exp_avg);
    state.read("exp_avg_sq", exp_avg_sq);
    moments.push_back(exp_avg.flatten());
    moments.push_back(exp_avg_sq.flatten());
  }
  return {moments.empty() ? torch::zeros({0}) : torch::cat(moments), with_state};
}

constexpr int64_t kMlpParameters = 6 * 16 + 16 + 16 * 16 + 16 + 16 * 3 + 3;  // 435, in 6 tensors

}  // namespace

BOOST_AUTO_TEST_CASE(zero_owners_balance_the_elements_and_bad_settings_are_named) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  for (int world : {2, 3, 4}) {
    int64_t total = 0, most = 0, least = kMlpParameters;
    const auto layout = std::make_shared<const tl::distributed::FlatLayout>(adam, world);
    for (int r = 0; r < world; ++r) {
      total += layout->owned_elements(r);
      most = std::max(most, layout->owned_elements(r));
      least = std::min(least, layout->owned_elements(r));
    }
    BOOST_TEST(total == kMlpParameters);                                    // every element has exactly one owner
    BOOST_TEST(most == (kMlpParameters + world - 1) / world);               // exact shares: ceil(N / W)
    BOOST_TEST(most - least <= world);                                      // the last rank may hold a few less
    BOOST_TEST(tl::distributed::ZeroOptimizerShard(layout, 0).piece_count() >= 1u);
  }
  // The largest tensor (fc2's weight, 256 of 435 elements) is split between ranks 0 and 1 for W = 2.
  BOOST_TEST(tl::distributed::FlatLayout(adam, 2).owned_elements(0) == 218);
  // A tensor listed twice (tied weights) has one place in the layout, one state, and counts once.
  std::vector<torch::Tensor> tied = net->parameters();
  tied.push_back(net->fc2->weight);
  torch::optim::Adam tied_adam(tied, torch::optim::AdamOptions(0.01));
  for (int world : {2, 3}) {
    int64_t total = 0;
    const tl::distributed::FlatLayout layout(tied_adam, world);
    for (int r = 0; r < world; ++r) total += layout.owned_elements(r);
    BOOST_TEST(total == kMlpParameters);
    BOOST_TEST(layout.same_parameters(tied_adam));
    BOOST_TEST(!layout.same_parameters(adam));
  }
  torch::optim::LBFGS lbfgs(net->parameters(), torch::optim::LBFGSOptions(0.1));
  try {
    tl::distributed::ZeroOptimizerShard::check_optimizer(lbfgs);
    BOOST_FAIL("ZeRO accepted LBFGS");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("ZeRO is on with optimizer LBFGS, whose state is one history for all "
                                              "parameters") != std::string::npos);
  }
  tl::ModeFlags flags;
  flags.zero = true;
  try {
    tl::mode_from_flags(flags);
    BOOST_FAIL("ZeRO was accepted with gpu mode single");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("zero is 'on' with gpu mode 'single'; expected gpu mode ddp") !=
               std::string::npos);
  }
  flags.gpu_mode = "ddp";
  BOOST_TEST(std::get<tl::gpu_mode::DistributedDataParallel>(tl::mode_from_flags(flags).get()).zero());
}

// Levels 2 and 3 cut each unit (a submodule) in W chunks; units are named like FSDP's wrap policy.
BOOST_AUTO_TEST_CASE(sharding_units_are_the_named_submodules_and_bad_names_and_levels_are_named) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  const auto children = tl::distributed::assign_units(*net, {});
  BOOST_TEST(children.names == (std::vector<std::string>{"fc1", "fc2", "fc3"}));
  BOOST_TEST(children.unit_of.at(net->fc2->bias.unsafeGetTensorImpl()) == 1);
  for (int world : {2, 3}) {
    const tl::distributed::FlatLayout layout(adam, world, children.unit_of);
    BOOST_TEST(layout.unit_count() == 3u);
    BOOST_TEST(layout.unit_length(1) == 272);
    BOOST_TEST(layout.unit_chunk(1) == (272 + world - 1) / world);
    int64_t total = 0;
    for (int r = 0; r < world; ++r) total += layout.owned_elements(r);
    BOOST_TEST(total == kMlpParameters);  // every element has exactly one owner
  }
  // One named unit: fc2's two tensors; fc1's and fc3's form the unit of the rest.
  const auto one = tl::distributed::assign_units(*net, {"fc2"});
  BOOST_TEST(one.names == (std::vector<std::string>{"fc2", ""}));
  BOOST_TEST(one.unit_of.at(net->fc1->weight.unsafeGetTensorImpl()) == 1);
  BOOST_TEST(tl::distributed::FlatLayout(adam, 2, one.unit_of).unit_length(1) == 112 + 51);
  auto error_of = [](const std::function<void()>& body) {
    try {
      body();
    } catch (const tl::ConfigurationError& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  BOOST_TEST(error_of([&] { tl::distributed::assign_units(*net, {"fc9"}); }) ==
             "trainloop: sharding unit 'fc9' names no submodule of the model; expected a dotted submodule path such "
             "as one of its children: fc1, fc2, fc3");
  BOOST_TEST(error_of([] { tl::distributed::sharding_named("fsdp"); }) ==
             "trainloop: sharding is 'fsdp'; expected none, optimizer, gradients or full");
  tl::ModeFlags flags;
  flags.sharding = "full";
  BOOST_TEST(error_of([&] { tl::mode_from_flags(flags); }) ==
             "trainloop: sharding is 'full' with gpu mode 'single'; expected gpu mode ddp or fsdp (sharding splits the "
             "model over their processes) or sharding none");
  // `--gpu-mode ddp --sharding full` is the sharded mode; `--sharding optimizer` is ddp's ZeRO-1.
  flags.gpu_mode = "ddp";
  BOOST_TEST(std::get<tl::gpu_mode::FullyShardedDataParallel>(tl::mode_from_flags(flags).get()).sharding() ==
             tl::distributed::Sharding::Full);
  flags.sharding = "optimizer";
  BOOST_TEST(std::get<tl::gpu_mode::DistributedDataParallel>(tl::mode_from_flags(flags).get()).zero());
  flags.gpu_mode = "fsdp";
  flags.sharding = "none";
  BOOST_TEST(std::get<tl::gpu_mode::FullyShardedDataParallel>(tl::mode_from_flags(flags).get()).sharding() ==
             tl::distributed::Sharding::Full);
  flags.comm_hook = "fp16";
  BOOST_TEST(error_of([&] { tl::mode_from_flags(flags); }) ==
             "trainloop: comm hook is 'fp16' with gpu mode 'fsdp'; expected gpu mode ddp (hooks carry DDP's all-reduced "
             "gradients between processes; sharded gradients are reduce-scattered) or comm hook none");
  BOOST_TEST(error_of([] {
               tl::gpu_mode::FullyShardedDataParallel().sharding(tl::distributed::Sharding::Optimizer).validate();
             }) == "trainloop: fsdp's sharding is optimizer; expected gradients or full (sharding none and optimizer are "
                   "gpu_mode::DistributedDataParallel, the latter with zero(true))");
}

// Under torchrun a loop's ranks live on after a fit, holding the layout of the sharded parameters:
// a model whose parameters changed since is refused by name on every rank.
BOOST_AUTO_TEST_CASE(a_sharded_model_whose_parameters_change_between_fits_is_refused_naming_the_parameter) {
  const fs::path dir = fresh_dir("sharded_model_changes");
  const int port = tl::distributed::find_free_port();
  std::vector<FILE*> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string command = "TMPDIR=" + dir.string() + " RANK=" + std::to_string(rank) + " LOCAL_RANK=" +
                                std::to_string(rank) + " WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                std::to_string(port) + " " + DDP_WORKER_PATH + " sharded_model_changes 2 " + dir.string() +
                                " 2>&1";
    ranks.push_back(::popen(command.c_str(), "r"));
  }
  for (FILE* pipe : ranks) {
    std::string output;
    std::array<char, 4096> buffer{};
    while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
    const int status = ::pclose(pipe);
    BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 3), output);
    BOOST_TEST(output.find("the model's parameters changed since the last sharded fit: parameter 4 is 'fc3.weight' (a "
                           "new tensor or another name), was 'fc3.weight'") != std::string::npos, output);
  }
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(dir);
}

namespace {
/// The three sharding levels, as ddp_worker's settings, and the elements the rank holding the most
/// keeps state for: level 1 cuts the whole flat space, levels 2 and 3 each unit (fc1 112, fc2 272,
/// fc3 51 elements) in W chunks.
struct LevelCase {
  const char* name;
  const char* settings;
  bool by_unit;
};
constexpr LevelCase kLevels[] = {{"optimizer", "TL_TEST_ZERO=1 ", false},
                                 {"gradients", "TL_TEST_SHARDING=gradients ", true},
                                 {"full", "TL_TEST_SHARDING=full ", true}};
int64_t most_owned_elements(const LevelCase& level, int64_t world) {
  auto chunk = [world](int64_t n) { return (n + world - 1) / world; };
  return level.by_unit ? chunk(112) + chunk(272) + chunk(51) : chunk(kMlpParameters);
}
}  // namespace

// 20 steps of Adam with clipping: every sharding level equals plain DDP in the parameters and in
// every Adam moment (gathered into the checkpoint), and each rank holds about 1/W of the state.
BOOST_AUTO_TEST_CASE(every_sharding_level_with_adam_equals_plain_ddp_and_each_rank_holds_a_share_of_the_state) {
  for (int world : {2, 3}) {
    auto dir = fresh_dir("zero_vs_ddp_" + std::to_string(world));
    const std::string common = "TL_TEST_EPOCHS=4 TL_TEST_OPTIMIZER=adam TL_TEST_CLIP_PERCENT=50 ";
    auto ddp = run_worker("ckpt", world, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_ddp");
    BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
    const auto [ddp_moments, ddp_states] = adam_moments(dir / "ddp" / "last.ckpt");
    BOOST_TEST(ddp_states == 6);
    // Bytes of optimizer state on the rank holding the most: DDP the whole (2 moments x 4 bytes x 435).
    const double whole = 2 * 4 * kMlpParameters;
    BOOST_TEST(ddp.result["optimizer_state_bytes"] == whole);
    BOOST_TEST(ddp.result["optimizer_state_bytes_total"] == whole * world);
    for (const LevelCase& level : kLevels) {
      BOOST_TEST_CONTEXT("world " << world << ", sharding " << level.name) {
        auto zero = run_worker("ckpt", world, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                               std::string("_") + level.name);
        BOOST_REQUIRE_MESSAGE(zero.exit_code == 0, zero.output);
        BOOST_TEST(zero.result["steps"] == 20);
        const double params = (load_params((zero.dir / "params.pt").string()) - load_params((ddp.dir / "params.pt").string()))
                                  .abs().max().item<double>();
        const auto [zero_moments, zero_states] = adam_moments(dir / level.name / "last.ckpt");
        BOOST_TEST(zero_states == 6);  // the whole state, gathered from every rank
        BOOST_REQUIRE(zero_moments.sizes() == ddp_moments.sizes());
        const double moments = (zero_moments - ddp_moments).abs().max().item<double>();
        BOOST_TEST_MESSAGE("world " << world << ", sharding " << level.name << ", 20 Adam steps with clipping: max |level - ddp| "
                           "parameters " << params << ", moments " << moments << "; optimizer state on the rank holding "
                           "the most " << zero.result["optimizer_state_bytes"] << " bytes (ddp " << whole << ")");
        BOOST_TEST(params <= 1e-6);
        BOOST_TEST(moments <= 1e-6);
        // Exact shares: the rank holding the most has ceil(N / W) elements' moments (per unit at
        // levels 2 and 3), within one element per unit of 1/W, whatever the largest tensor.
        BOOST_TEST(zero.result["optimizer_state_bytes"] == 2 * 4 * most_owned_elements(level, world));
        // Every rank's bytes reach the History: each parameter's state is on exactly one rank.
        BOOST_TEST(zero.result["optimizer_state_ranks"] == world);
        BOOST_TEST(zero.result["optimizer_state_bytes_total"] == whole);
        fs::remove_all(zero.dir);
      }
    }
    fs::remove_all(ddp.dir);
    fs::remove_all(dir);
  }
}

// Without clipping nothing is summed in another order on 2 ranks: the reduce-scatter adds the same
// two numbers the all-reduce adds, so every level is plain DDP bit for bit. (On 3 ranks the
// reduce-scatter's sum order differs: 6e-8 after 20 steps, checked above with clipping.)
BOOST_AUTO_TEST_CASE(on_two_ranks_without_clipping_every_sharding_level_is_plain_ddp_bit_for_bit) {
  // Also with 2 micro-batches per step: the sharded levels keep whole local gradients until the
  // micro-batch that synchronizes, as plain DDP's no_sync does.
  for (const std::string accumulation : {"1", "2"}) {
    BOOST_TEST_CONTEXT("accumulation " << accumulation) {
      auto dir = fresh_dir("zero_bit_for_bit_" + accumulation);
      const std::string common = "TL_TEST_EPOCHS=4 TL_TEST_OPTIMIZER=adam TL_TEST_ACCUMULATION=" + accumulation + " ";
      auto ddp = run_worker("ckpt", 2, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_exact_ddp" + accumulation);
      BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
      const torch::Tensor ddp_params = load_params((ddp.dir / "params.pt").string());
      for (const LevelCase& level : kLevels) {
        BOOST_TEST_CONTEXT("sharding " << level.name) {
          auto run = run_worker("ckpt", 2, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                                std::string("_exact_") + level.name + accumulation);
          BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
          BOOST_TEST((load_params((run.dir / "params.pt").string()) - ddp_params).abs().max().item<double>() == 0.0);
          fs::remove_all(run.dir);
        }
      }
      fs::remove_all(ddp.dir);
      fs::remove_all(dir);
    }
  }
}

// A frozen layer still in the optimizer (a fine-tuned backbone) gets no gradient at any level, so
// AdamW's weight decay never touches it, as in plain DDP.
BOOST_AUTO_TEST_CASE(a_frozen_layer_in_the_optimizer_stays_as_it_was_at_every_sharding_level) {
  auto dir = fresh_dir("frozen_sharded");
  const std::string common = "TL_TEST_EPOCHS=2 TL_TEST_OPTIMIZER=adamw TL_TEST_FREEZE_FIRST=1 ";
  auto ddp = run_worker("ckpt", 2, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_frozen_ddp");
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  torch::manual_seed(5);
  Mlp initial;  // the worker's weights before training
  const torch::Tensor first_layer = flat_params(initial->fc1->parameters());
  const torch::Tensor ddp_params = load_params((ddp.dir / "params.pt").string());
  BOOST_TEST((ddp_params.narrow(0, 0, first_layer.numel()) - first_layer).abs().max().item<double>() == 0.0);
  for (const LevelCase& level : kLevels) {
    BOOST_TEST_CONTEXT("sharding " << level.name) {
      auto run = run_worker("ckpt", 2, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                            std::string("_frozen_") + level.name);
      BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
      const torch::Tensor params = load_params((run.dir / "params.pt").string());
      BOOST_TEST((params.narrow(0, 0, first_layer.numel()) - first_layer).abs().max().item<double>() == 0.0);
      BOOST_TEST((params - ddp_params).abs().max().item<double>() <= 1e-6);
      fs::remove_all(run.dir);
    }
  }
  fs::remove_all(ddp.dir);
  fs::remove_all(dir);
}

// Each sharding level: killed and restarted, bit for bit; its checkpoints resume in plain DDP, in
// another world size and in one process, and plain DDP's resume in it.
BOOST_AUTO_TEST_CASE(every_sharding_level_restarts_bit_for_bit_and_its_checkpoints_resume_in_any_mode_and_world_size) {
  for (const LevelCase& level : kLevels) {
    BOOST_TEST_CONTEXT("sharding " << level.name) {
      auto dir = fresh_dir(std::string("zero_ckpt_") + level.name);
      const std::string adam = "TL_TEST_OPTIMIZER=adam ", zero = adam + level.settings;
      auto full = run_ckpt("zero_full", dir / "full", zero + "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2");
      BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
      // Rank 1 killed at step 7 (inside epoch 2): all ranks restart from the step-6 checkpoint.
      auto killed = run_ckpt("zero_killed", dir / "killed",
                             zero + "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_KILL_AT_STEP=7 TL_TEST_MAX_RESTARTS=1");
      BOOST_REQUIRE_MESSAGE(killed.exit_code == 0, killed.output);
      BOOST_TEST(killed.output.find("restarting all ranks from the newest checkpoint") != std::string::npos);
      BOOST_TEST(torch::equal(load_params((killed.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
      BOOST_TEST(leftover_workers() == 0);

      // 2 epochs with ZeRO, then the third in plain DDP from ZeRO's checkpoint: as 3 epochs of ZeRO.
      auto first = run_ckpt("zero_first", dir / "mixed", zero + "TL_TEST_EPOCHS=2");
      BOOST_REQUIRE_MESSAGE(first.exit_code == 0, first.output);
      fs::copy(dir / "mixed", dir / "three_ranks", fs::copy_options::recursive);
      fs::copy(dir / "mixed", dir / "back_to_zero", fs::copy_options::recursive);
      auto in_ddp = run_ckpt("ddp_second", dir / "mixed", adam + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
      BOOST_REQUIRE_MESSAGE(in_ddp.exit_code == 0, in_ddp.output);
      BOOST_TEST(in_ddp.result["epochs"] == 3);
      const double mixed = (load_params((in_ddp.dir / "params.pt").string()) - load_params((full.dir / "params.pt").string()))
                               .abs().max().item<double>();
      BOOST_TEST_MESSAGE("sharding " << level.name << ": 2 epochs sharded + 1 epoch plain DDP vs 3 epochs sharded: max |diff| " << mixed);
      BOOST_TEST(mixed <= 1e-6);
      // ... and plain DDP's checkpoint of epoch 3 continues in ZeRO; ZeRO's in 3 ranks (another world size).
      auto ddp_then_zero = run_ckpt("zero_third", dir / "mixed", zero + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
      BOOST_REQUIRE_MESSAGE(ddp_then_zero.exit_code == 0, ddp_then_zero.output);
      BOOST_TEST(ddp_then_zero.result["epochs"] == 4);
      auto three = run_worker("ckpt", 3, 0, zero + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last TL_TEST_CKPT_DIR=" +
                                                (dir / "three_ranks").string(), "_zero_three");
      BOOST_REQUIRE_MESSAGE(three.exit_code == 0, three.output);
      BOOST_TEST(three.result["epochs"] == 3);
      BOOST_TEST(adam_moments(dir / "three_ranks" / "last.ckpt").second == 6);
      // ... and in one process, with every parameter's Adam state.
      torch::manual_seed(5);
      Mlp net;
      torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(0.01));
      tl::TrainLoop<Mlp> one(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                             tl::TrainLoopOptions().batch_size(8));
      one.load_checkpoint(dir / "back_to_zero" / "last.ckpt");
      BOOST_TEST(optimizer.state().size() == 6u);
      BOOST_TEST(tl::optimizer_state_bytes(optimizer) == 2 * 4 * kMlpParameters);
      for (auto* run : {&full, &killed, &first, &in_ddp, &ddp_then_zero, &three}) fs::remove_all(run->dir);
      fs::remove_all(dir);
    }
  }
}

// PowerSGD's state (Q and error feedback, per rank) is in the checkpoints: 20 steps, compression
// from step 11, rank 1 killed at step 15, all ranks restart from step 14's checkpoint.
BOOST_AUTO_TEST_CASE(a_powersgd_run_killed_after_compression_began_restarts_bit_for_bit) {
  auto dir = fresh_dir("powersgd_ckpt");
  const std::string common = "TL_TEST_COMM_HOOK=powersgd:2 TL_TEST_EPOCHS=4 TL_TEST_EVERY_STEPS=2 ";
  auto full = run_ckpt("powersgd_full", dir / "full", common);
  BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
  auto killed = run_ckpt("powersgd_killed", dir / "killed", common + "TL_TEST_KILL_AT_STEP=15 TL_TEST_MAX_RESTARTS=1");
  BOOST_REQUIRE_MESSAGE(killed.exit_code == 0, killed.output);
  BOOST_TEST(killed.output.find("restarting all ranks from the newest checkpoint") != std::string::npos);
  BOOST_TEST(torch::equal(load_params((killed.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
  // The checkpoint holds both ranks' state, and PowerSGD changed the result (it is not the all-reduce).
  torch::serialize::InputArchive archive, ours, optimizer, hooks;
  archive.load_from((dir / "full" / "last.ckpt").string());
  BOOST_REQUIRE(archive.try_read("__trainloop__", ours) && ours.try_read("optimizer", optimizer));
  BOOST_REQUIRE(optimizer.try_read("trainloop_comm_hook", hooks));
  torch::Tensor rank0, rank1;
  BOOST_TEST((hooks.try_read("rank0", rank0) && hooks.try_read("rank1", rank1)));
  auto plain = run_ckpt("powersgd_none", dir / "none", "TL_TEST_EPOCHS=4");
  BOOST_REQUIRE_MESSAGE(plain.exit_code == 0, plain.output);
  const double compressed = (load_params((full.dir / "params.pt").string()) - load_params((plain.dir / "params.pt").string()))
                                .abs().max().item<double>();
  BOOST_TEST_MESSAGE("PowerSGD rank 2 vs the all-reduce after 20 steps: max |diff| " << compressed);
  BOOST_TEST(compressed > 1e-6);
  for (auto* run : {&full, &killed, &plain}) fs::remove_all(run->dir);
  fs::remove_all(dir);
}
