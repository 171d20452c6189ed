// A rank program for test_launcher: what each rank does is chosen by TL_TEST_SCENARIO, files go
// to TL_TEST_OUT_DIR (default: the run directory).
//
// It includes only the torch-free child side (rank_env.hpp, spawned_rank.hpp) and does not link
// libtorch: a binary linked to libtorch takes about a second to start on the test machine, this
// one a few milliseconds, which keeps the many launches in test_launcher fast.

#include "test_support.hpp"

#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/spawned_rank.hpp>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <fcntl.h>
#include <unistd.h>

namespace distributed = trainloop::distributed;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

/// Waits until every rank of the job has started (each writes its pid file first): a rank that
/// fails "while the others run" then does so for sure, whatever the machine's speed or load.
void wait_for_every_rank(const fs::path& out, int world_size) {
  for (int rank = 0; rank < world_size; ++rank) {
    while (!fs::exists(out / ("pid" + std::to_string(rank)))) std::this_thread::sleep_for(1ms);
  }
}

/// Where the SIGTERM handler leaves its mark: a path prepared before the signal can come, as a
/// handler may only call async-signal-safe functions (open, close).
char sigterm_mark[4096] = {};
volatile std::sig_atomic_t got_sigterm = 0;
extern "C" void note_sigterm(int) {
  got_sigterm = 1;
  const int fd = ::open(sigterm_mark, O_CREAT | O_WRONLY, 0644);
  if (fd >= 0) ::close(fd);
}
void handle_sigterm(const fs::path& mark) {
  std::snprintf(sigterm_mark, sizeof sigterm_mark, "%s", mark.c_str());
  struct sigaction action {};
  action.sa_handler = note_sigterm;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
}

void run_scenario(const distributed::RankEnv& env) {
  const std::string scenario = env_or("TL_TEST_SCENARIO");
  const fs::path out = env_or("TL_TEST_OUT_DIR", env.run_dir);
  write_file(out / ("pid" + std::to_string(env.rank)), std::to_string(::getpid()));
  if (scenario == "succeed") {
    std::ostringstream line;
    line << env.rank << ' ' << env.world_size << ' ' << env.local_rank << ' '
         << env.local_world_size << ' ' << env.node_rank << ' ' << env.master_port << ' '
         << env_or("OMP_NUM_THREADS", "unset") << ' ' << env_or("TL_TEST_EXTRA", "unset");
    write_file(out / ("rank" + std::to_string(env.rank) + ".txt"), line.str());
    return;
  }
  if (scenario == "fail_rank1" && env.rank == 1) {
    wait_for_every_rank(out, env.world_size);
    throw std::runtime_error("rank 1 exploded on purpose");
  }
  if (scenario == "sigkill_rank2" && env.rank == 2) {
    wait_for_every_rank(out, env.world_size);
    ::kill(::getpid(), SIGKILL);
  }
  if (scenario == "ignore_term") {
    if (env.rank == 1) {  // notes SIGTERM and carries on, as a rank stuck in a collective would
      handle_sigterm(out / "got_sigterm1");
      write_file(out / "ignoring", "1");
    } else {  // fail only once rank 1 surely ignores SIGTERM
      while (!fs::exists(out / "ignoring")) std::this_thread::sleep_for(5ms);
      throw std::runtime_error("rank 0 fails while rank 1 ignores SIGTERM");
    }
  }
  if (scenario == "clean_up_on_term") {
    if (env.rank == 1) {  // ends by itself after SIGTERM, after some cleaning up
      handle_sigterm(out / "got_sigterm1");
      write_file(out / "ready", "1");
      while (got_sigterm == 0) std::this_thread::sleep_for(1ms);
      // Cleaning up takes a while: a launcher that did not wait the grace period would SIGKILL
      // the rank meanwhile. (The test's grace period is far longer: no check depends on this.)
      std::this_thread::sleep_for(100ms);
      write_file(out / "cleaned_up1", "1");
      std::exit(0);
    }
    while (!fs::exists(out / "ready")) std::this_thread::sleep_for(1ms);
    throw std::runtime_error("rank 0 fails while rank 1 can clean up");
  }
  if (scenario == "crash_and_peer_reports") {
    // Rank 1 crashes; rank 0 notices at once, as a collective would ("Connection reset by peer"),
    // so both can be reaped in the same poll of the launcher, the peer possibly first.
    if (env.rank == 1) {
      write_file(out / "crashing", "1");
      std::raise(SIGSEGV);
    }
    while (!fs::exists(out / "crashing")) std::this_thread::sleep_for(1ms);
    if (env_or("TL_TEST_PEER_DIES_OF") == "SIGPIPE") std::raise(SIGPIPE);  // wrote to the dead peer's socket
    throw trainloop::CommunicationError("gloo: Read error [127.0.0.1]:1234: Connection reset by peer");
  }
  if (scenario == "grandchild") {
    // A program the rank starts (through a shell) inherits the TRAINLOOP_* variables; it must
    // not take itself for an orphaned rank and kill itself.
    const std::string self = fs::read_symlink("/proc/self/exe").string();
    const int status = std::system((self + " grandchild " + (out / ("grandchild" + std::to_string(env.rank))).string()).c_str());
    write_file(out / ("grandchild_status" + std::to_string(env.rank)), std::to_string(status));
    return;
  }
  if (scenario == "exit0_rank1" && env.rank == 1) {
    wait_for_every_rank(out, env.world_size);
    std::exit(0);  // user code ending the program while the other ranks still train
  }
  std::this_thread::sleep_for(60s);  // stands for a rank blocked in a collective
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 3 && std::string(argv[1]) == "grandchild") {
    write_file(argv[2], "ran");
    return 0;
  }
  auto env = distributed::detect_rank_env();
  if (!env || env->source != distributed::RankEnvSource::Trainloop) {
    std::fprintf(stderr, "launcher_child: expected to be started by trainloop::distributed::Launcher\n");
    return 2;
  }
  return distributed::run_reporting_failure(*env, [&] { run_scenario(*env); });
}
