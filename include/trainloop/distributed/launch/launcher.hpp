#pragma once
/// @file
/// @brief Starting the local ranks of a DDP job by re-executing this program, watching them,
/// and stopping all of them when one fails.
///
/// Parent side: `Launcher(LaunchOptions(nprocs)).launch()` posix_spawns /proc/self/exe with
/// this process's own argv (read from /proc/self/cmdline, so main's argv is not needed) and
/// environment, plus the TRAINLOOP_* variables listed in rank_env.hpp and OMP_NUM_THREADS
/// (threads.hpp). It returns when every rank exited 0; otherwise it stops the others and
/// throws trainloop::RankFailedError leading with the failed rank's own error text.
///
/// The child side (dying with the launcher, reporting a failure or completion) is in
/// spawned_rank.hpp; the files between the two in failure_report.hpp.
///
/// Process lifetime rules, and why:
/// - Children stay in the launcher's process group. A terminal's Ctrl-C (SIGINT), Ctrl-\ and
///   hang-up reach the whole foreground group, so every rank gets them directly, as the
///   launcher does; a batch system or user killing the group (`kill -- -PGID`) gets everything.
///   A separate group would make those signals miss the ranks. The launcher itself never
///   signals the group (that would hit itself and its caller's other children): it signals
///   each child by pid, which it knows.
/// - Each child asks for PR_SET_PDEATHSIG(SIGKILL) before its main() (spawned_rank.hpp), so a
///   launcher killed by SIGKILL (no chance to clean up) takes its ranks with it. The kernel fires
///   it when the *thread* that spawned the child ends; launch() blocks that thread until every
///   child is reaped, so this only fires when the launching process dies. Its run directory is
///   then removed by the next launcher (run_directory.hpp).
/// - While launch() runs, SIGINT, SIGTERM and SIGHUP sent to the launching process (unless
///   that process ignores them) stop every rank (SIGTERM, grace period, SIGKILL) and are then
///   re-raised with the caller's own disposition restored: the default kills the process
///   with that signal as usual; if a handler returns instead, launch() throws. SIGCHLD is set
///   to its default meanwhile if the program ignored it (posix_process.hpp).

#include <trainloop/cpu/threads.hpp>
#include <trainloop/distributed/job/group_formed.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/failure_report.hpp>
#include <trainloop/distributed/launch/free_port.hpp>
#include <trainloop/distributed/launch/launch_options.hpp>
#include <trainloop/distributed/launch/posix_process.hpp>
#include <trainloop/distributed/launch/rank_replacements.hpp>
#include <trainloop/distributed/launch/run_directory.hpp>
#include <trainloop/distributed/launch/spawned_rank.hpp>
#include <trainloop/error.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

extern char** environ;

namespace trainloop::distributed {

/// Starts `nprocs` local ranks, watches them, stops them all when one fails.
/// The run directory is created by the constructor (so the caller can put files there before
/// launch) and removed by the destructor (unless keep_run_dir), so files the ranks leave
/// there, such as rank 0's final weights, stay readable after launch() returns.
class Launcher {
 public:
  /// Checks the options, resolves the master port (0 → a free port) and creates the run dir.
  explicit Launcher(LaunchOptions options);
  Launcher(const Launcher&) = delete;
  Launcher& operator=(const Launcher&) = delete;
  /// Kills children still running (only possible if launch() was never completed) and removes
  /// the run directory unless keep_run_dir.
  ~Launcher();

  /// Spawns the ranks and waits for them. Can be called once.
  /// @return every rank's record, all with exit code 0.
  /// @throws trainloop::RankFailedError when a rank exits non-zero, is killed by a signal or
  ///         (require_completion) exits 0 before its work was done, after every other rank was
  ///         stopped and reaped. The message leads with the rank that failed first and its own
  ///         error text, and names the file with its complete error (backtrace included).
  const std::vector<RankProcess>& launch();

  /// The run directory shared with the ranks (TRAINLOOP_RUN_DIR).
  const std::string& run_dir() const { return run_dir_; }
  /// The master port the ranks are told (chosen here when the options said 0).
  int master_port() const { return master_port_; }
  /// The ranks started so far, in local-rank order, with pids and outcomes (also after a throw).
  const std::vector<RankProcess>& ranks() const { return ranks_; }
  /// The options the launcher was built with.
  const LaunchOptions& options() const { return options_; }

 private:
  std::vector<std::string> child_environment(const RankProcess& process) const;
  void spawn(RankProcess& process, const std::vector<std::string>& argv);
  bool reap(RankProcess& process, bool block);
  void stop_all();
  void remove_run_dir() noexcept;

  /// How long a failure that only reports a lost peer waits for the rank that caused it.
  static constexpr std::chrono::milliseconds kCauseGracePeriod{1000};

  LaunchOptions options_;
  std::string run_dir_;
  bool created_run_dir_ = false;
  int master_port_ = 0;
  bool launched_ = false;
  std::vector<RankProcess> ranks_;
};

inline Launcher::Launcher(LaunchOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  TRAINLOOP_CHECK(o.nprocs() >= 1, "nprocs is ", o.nprocs(), "; expected >= 1");
  TRAINLOOP_CHECK(o.nnodes() >= 1, "nnodes is ", o.nnodes(), "; expected >= 1");
  TRAINLOOP_CHECK(o.node_rank() >= 0 && o.node_rank() < o.nnodes(), "node_rank is ",
                  o.node_rank(), "; expected 0 <= node_rank < nnodes = ", o.nnodes());
  TRAINLOOP_CHECK(o.master_port() >= 0 && o.master_port() <= 65535, "master port is ",
                  o.master_port(), "; expected 1..65535, or 0 to pick a free one");
  TRAINLOOP_CHECK(o.grace_period().count() >= 0 && o.poll_interval().count() > 0,
                  "grace_period is ", o.grace_period().count(), " ms and poll_interval ",
                  o.poll_interval().count(), " ms; expected >= 0 and > 0");
  if (o.master_port() == 0) {
    // Other nodes could not learn a port chosen here.
    TRAINLOOP_CHECK(o.nnodes() == 1, "master port 0 (pick a free one) with nnodes = ",
                    o.nnodes(), "; expected an explicit master port when nnodes > 1");
    master_port_ = find_free_port(o.master_addr());
  } else {
    master_port_ = o.master_port();
    if (o.check_port() && o.node_rank() == 0) check_port_available(o.master_addr(), master_port_);
  }
  const std::filesystem::path parent =
      o.run_dir_parent().empty() ? temporary_root() : std::filesystem::path(o.run_dir_parent());
  remove_stale_run_directories(parent);  // left by launchers that were killed (SIGKILL, OOM killer)
  run_dir_ = create_owned_directory(parent, "trainloop-run").string();
  created_run_dir_ = true;
}

inline Launcher::~Launcher() {
  for (auto& process : ranks_) {
    if (process.running) {
      ::kill(process.pid, SIGKILL);
      reap(process, /*block=*/true);
    }
  }
  remove_run_dir();
}

inline void Launcher::remove_run_dir() noexcept {
  if (created_run_dir_ && !options_.keep_run_dir()) {
    std::error_code ignored;
    std::filesystem::remove_all(run_dir_, ignored);
    created_run_dir_ = false;
  }
  if (options_.elastic()) remove_elastic_hand_off_files(::getpid());
}

inline std::vector<std::string> Launcher::child_environment(const RankProcess& process) const {
  const int local_rank = process.local_rank;
  const auto& o = options_;
  EnvVars overrides;
  if (auto threads = cpu::omp_num_threads_for_children(o.nprocs())) overrides["OMP_NUM_THREADS"] = *threads;
  if (auto blas = cpu::blas_threads_for_children()) overrides["OPENBLAS_NUM_THREADS"] = *blas;
  for (const auto& [name, value] : o.env()) overrides[name] = value;
  overrides[env_names::rank] = std::to_string(o.node_rank() * o.nprocs() + local_rank);
  overrides[env_names::world_size] = std::to_string(o.nnodes() * o.nprocs());
  overrides[env_names::local_rank] = std::to_string(local_rank);
  overrides[env_names::local_world_size] = std::to_string(o.nprocs());
  overrides[env_names::node_rank] = std::to_string(o.node_rank());
  overrides[env_names::master_addr] = o.master_addr();
  overrides[env_names::master_port] = std::to_string(master_port_);
  overrides[env_names::run_dir] = run_dir_;
  overrides[env_names::launcher_pid] = std::to_string(::getpid());
  if (process.replacement > 0) overrides[env_names::replacement] = std::to_string(process.replacement);

  std::vector<std::string> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    if (!overrides.count(std::string(text.substr(0, text.find('='))))) entries.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) entries.push_back(name + "=" + value);
  return entries;
}

inline void Launcher::spawn(RankProcess& process, const std::vector<std::string>& argv) {
  // A replacement writes after the log of the process it replaces.
  const std::string log = options_.log_to_files() ? run_dir_ + "/rank" + std::to_string(process.rank) + ".log" : std::string();
  process.started = std::chrono::steady_clock::now();
  process.pid = detail::spawn_process(options_.executable(), argv, child_environment(process), log, process.replacement > 0,
                                      "rank " + std::to_string(process.rank));
  process.running = true;
}

/// Collects `process`'s exit status if it has ended (or, with `block`, once it ends).
/// @return true when the process is (now) reaped.
inline bool Launcher::reap(RankProcess& process, bool block) {
  if (!process.running) return true;
  int status = 0;
  pid_t result;
  do {
    result = ::waitpid(process.pid, &status, block ? 0 : WNOHANG);
  } while (result < 0 && errno == EINTR);
  if (result == 0) return false;
  process.running = false;
  process.exited = true;
  process.wall_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - process.started).count();
  if (result < 0) {
    // ECHILD: reaped elsewhere (a SIGCHLD handler of the program's own that waits for any child).
    // Its done marker, when required, still says whether it finished its work.
    if (options_.require_completion() && std::filesystem::exists(rank_done_path(run_dir_, process.rank))) {
      process.exit_code = 0;
    }
    return true;
  }
  if (WIFEXITED(status)) process.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) process.signal = WTERMSIG(status);
  if (options_.require_completion() && process.signal == 0 && process.exit_code == 0 &&
      !std::filesystem::exists(rank_done_path(run_dir_, process.rank))) {
    process.ended_early = true;
  }
  return true;
}

/// SIGTERM to every running rank, SIGKILL to those still running after the grace period,
/// then reaps them all.
inline void Launcher::stop_all() {
  for (auto& process : ranks_) {
    if (!process.running) continue;
    process.stopped_by_launcher = true;
    ::kill(process.pid, SIGTERM);
  }
  const auto deadline = std::chrono::steady_clock::now() + options_.grace_period();
  auto any_running = [&] {
    bool running = false;
    for (auto& process : ranks_) running = !reap(process, false) || running;
    return running;
  };
  while (any_running() && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(options_.poll_interval());
  }
  for (auto& process : ranks_) {
    if (process.running) ::kill(process.pid, SIGKILL);
  }
  for (auto& process : ranks_) reap(process, /*block=*/true);
}

inline const std::vector<RankProcess>& Launcher::launch() {
  TRAINLOOP_CHECK(!launched_, "Launcher::launch() called twice; expected one launch per Launcher");
  launched_ = true;
  const std::vector<std::string> argv =
      options_.argv().empty() ? detail::read_own_cmdline() : options_.argv();
  detail::InterruptGuard interrupts;
  detail::ReapOwnChildrenGuard reap_own_children;
  if (options_.joins_running_fit()) say_this_machine_stands_in(options_, master_port_);
  for (int local_rank = 0; local_rank < options_.nprocs(); ++local_rank) {
    RankProcess process;
    process.local_rank = local_rank;
    process.rank = options_.node_rank() * options_.nprocs() + local_rank;
    process.replacement = options_.joins_running_fit() ? 1 : 0;
    ranks_.push_back(process);
    try {
      spawn(ranks_.back(), argv);
    } catch (...) {
      ranks_.pop_back();
      stop_all();
      throw;
    }
  }
  std::optional<std::chrono::steady_clock::time_point> first_consequence_seen;
  while (true) {
    std::vector<const RankProcess*> failed;
    std::vector<int> lost_ranks;
    bool any_running = false;
    for (auto& process : ranks_) {
      if (reap(process, false) && !process.succeeded() && !process.stopped_by_launcher && !process.lost) {
        // Elastic training: the others regroup without it (distributed/elastic/) and name it — once
        // the job's group formed (before, they wait for it in the rendezvous: job/group_formed.hpp).
        const bool may_be_lost = options_.elastic() && process.rank != 0;  // rank 0 holds the store
        const bool group_formed = process.replacement > 0 || std::filesystem::exists(group_formed_mark(run_dir_));
        process.lost = may_be_lost && group_formed;
        if (may_be_lost && !group_formed) {
          std::cerr << "trainloop: rank " << process.rank << " (pid " << process.pid << ") was lost before the job's group "
                    << "formed; elastic training goes on only from a formed group, so the job ends\n";
        }
        if (!process.lost) {
          failed.push_back(&process);
        } else {
          std::cerr << "trainloop: rank " << process.rank << " (pid " << process.pid << ") " << process.describe()
                    << "; elastic training: the others go on without it\n";
          lost_ranks.push_back(process.rank);
        }
      }
      any_running = any_running || process.running;
    }
    // Replacements only while the job goes on (ranks_ grows: no pointer into it is held then) —
    // on several machines it may go on elsewhere when every rank of this one was lost.
    if (failed.empty() && (any_running || options_.nnodes() > 1) && !lost_ranks.empty()) {
      start_replacements(ranks_, options_, lost_ranks, [&](RankProcess& process) { spawn(process, argv); });
      any_running = std::any_of(ranks_.begin(), ranks_.end(), [](const RankProcess& process) { return process.running; });
    }
    if (int signal = detail::launcher_interrupt; signal != 0) {
      stop_all();
      remove_run_dir();  // the default disposition ends the process: no destructor will run
      interrupts.restore();
      ::raise(signal);  // the caller's own disposition: by default this ends the process
      throw Error(::trainloop::detail::concat("trainloop: launch interrupted by ", detail::signal_name(signal),
                                              "; all ", ranks_.size(), " ranks were stopped"));
    }
    // When every failure seen so far only reports a lost peer, the rank that caused it is most
    // likely dying right now (its peers noticed within milliseconds): give it a moment to be
    // reaped, so that it, not its peer, is named.
    const bool only_consequences = std::all_of(failed.begin(), failed.end(), [&](const RankProcess* process) {
      return process->signal == SIGPIPE || read_rank_error(run_dir_, process->rank).consequence;
    });
    if (!failed.empty() && only_consequences && any_running) {
      if (!first_consequence_seen) first_consequence_seen = std::chrono::steady_clock::now();
      if (std::chrono::steady_clock::now() - *first_consequence_seen < kCauseGracePeriod) {
        std::this_thread::sleep_for(options_.poll_interval());
        continue;
      }
    }
    if (!failed.empty()) {
      stop_all();  // ranks_ is not resized from here on, so `failed` stays valid
      order_by_first_failure(run_dir_, failed);
      throw rank_failure_error(run_dir_,
                               FailureContext{options_.node_rank(), options_.error_file_dir(), options_.log_to_files(),
                                              options_.grace_period()},
                               ranks_, failed);
    }
    if (!any_running) return ranks_;
    std::this_thread::sleep_for(options_.poll_interval());
  }
}

}  // namespace trainloop::distributed
