#define BOOST_TEST_MODULE test_ddp
#include "unit_test.hpp"

#include "test_paths.hpp"

// DistributedDataParallel as a user meets it: equal to one process on the combined batch, every way
// of launching ranks (spawned by fit(), started by hand with torchrun's variables), failures that
// end the job cleanly and say what happened, and checkpoints, resume and restarts under DDP.
// Sharding levels: test_sharding; comm hooks: test_comm_hooks; every mode against one reference:
// test_equivalence.

#include "ddp_test_support.hpp"
#include "small_tmpfs.hpp"

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
  std::string command = "(" + common + "RANK=0 LOCAL_RANK=0 " + test_program("ddp_worker") + " train 2 " + dir.string() + " & " +
                        common + "RANK=1 LOCAL_RANK=1 " + test_program("ddp_worker") + " train 2 " + dir.string() +
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
  const std::string path = test_program("ddp_worker");
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
