#pragma once
/// @file
/// @brief Starting the local ranks of a DDP job by re-executing this program, watching them,
/// and stopping all of them when one fails (DESIGN §4.2).
///
/// Parent side: `Launcher(LaunchOptions(nprocs)).launch()` posix_spawns /proc/self/exe with
/// this process's own argv (read from /proc/self/cmdline, so main's argv is not needed) and
/// environment, plus the TRAINLOOP_* variables listed in rank_env.hpp and OMP_NUM_THREADS
/// (threads.hpp). It returns when every rank exited 0; otherwise it stops the others and
/// throws trainloop::Error naming the failed rank, how it ended and the tail of its error text.
///
/// The child side (die_with_parent, report_rank_failure, run_reporting_failure) is in
/// spawned_rank.hpp.
///
/// Process lifetime rules, and why:
/// - Children stay in the launcher's process group. A terminal's Ctrl-C (SIGINT), Ctrl-\ and
///   hang-up reach the whole foreground group, so every rank gets them directly, as the
///   launcher does; a batch system or user killing the group (`kill -- -PGID`) gets everything.
///   A separate group would make those signals miss the ranks. The launcher itself never
///   signals the group (that would hit itself and its caller's other children): it signals
///   each child by pid, which it knows.
/// - Each child asks for PR_SET_PDEATHSIG(SIGKILL) in die_with_parent(), so a launcher killed
///   by SIGKILL (no chance to clean up) takes its ranks with it. The kernel fires it when the
///   *thread* that spawned the child ends; launch() blocks that thread until every child is
///   reaped, so this only fires when the launching process dies.
/// - While launch() runs, SIGINT, SIGTERM and SIGHUP sent to the launching process (unless
///   that process ignores them) stop every rank (SIGTERM, grace period, SIGKILL) and are then
///   re-raised with the caller's own disposition restored: the default kills the process
///   with that signal as usual; if a handler returns instead, launch() throws.

#include <trainloop/dist/free_port.hpp>
#include <trainloop/dist/rank_env.hpp>
#include <trainloop/dist/spawned_rank.hpp>
#include <trainloop/dist/threads.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iterator>
#include <map>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <utility>
#include <vector>

extern char** environ;

namespace trainloop::dist {

/// Extra environment for the children: name → value, overriding inherited values.
using EnvVars = std::map<std::string, std::string>;

/// What to start and how to watch it. Only `nprocs` is required.
struct LaunchOptions {
  /// @param nprocs number of ranks to start on this node
  explicit LaunchOptions(int nprocs) : nprocs_(nprocs) {}
  /// Number of ranks started on this node (local ranks 0..nprocs-1).
  TORCH_ARG(int, nprocs);
  /// Number of nodes; world size = nnodes * nprocs.
  TORCH_ARG(int, nnodes) = 1;
  /// This node's index; global rank = node_rank * nprocs + local rank.
  TORCH_ARG(int, node_rank) = 0;
  /// Host of rank 0's TCPStore, as the ranks should reach it.
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Port of rank 0's TCPStore; 0 picks a free one (single node only).
  TORCH_ARG(int, master_port) = 0;
  /// On node 0, fail early with a clear message when master_port is already taken.
  TORCH_ARG(bool, check_port) = true;
  /// How long stopped ranks get between SIGTERM and SIGKILL.
  TORCH_ARG(std::chrono::milliseconds, grace_period) = std::chrono::seconds(3);
  /// How often the launcher looks at its children.
  TORCH_ARG(std::chrono::milliseconds, poll_interval) = std::chrono::milliseconds(10);
  /// Keep the run directory after the Launcher is destroyed (for debugging).
  TORCH_ARG(bool, keep_run_dir) = false;
  /// Send each rank's stdout and stderr to `<run_dir>/rank<N>.log` instead of the terminal.
  TORCH_ARG(bool, log_to_files) = false;
  /// Extra variables for every child (they override inherited ones, not the TRAINLOOP_* ones).
  TORCH_ARG(EnvVars, env) = {};
  /// Program to run; the default re-executes this very binary.
  TORCH_ARG(std::string, executable) = "/proc/self/exe";
  /// Arguments including argv[0]; empty means this process's own, from /proc/self/cmdline.
  TORCH_ARG(std::vector<std::string>, argv) = {};
};

/// One started rank and, once it ended, how.
struct RankProcess {
  int rank = 0;        ///< global rank
  int local_rank = 0;  ///< rank on this node
  pid_t pid = -1;      ///< process id (stays set after the process was reaped)
  bool running = false;                 ///< spawned and not yet reaped
  bool exited = false;                  ///< reaped; exit_code or signal says how it ended
  int exit_code = -1;                   ///< exit status when it exited normally, else -1
  int signal = 0;                       ///< terminating signal when killed, else 0
  bool stopped_by_launcher = false;     ///< it was still running when the launcher stopped all
  double wall_seconds = 0.0;            ///< spawn to reap
  std::chrono::steady_clock::time_point started{};  ///< when it was spawned

  /// True when the rank exited with status 0.
  bool succeeded() const { return exited && signal == 0 && exit_code == 0; }
  /// "exit code 1", "killed by SIGKILL (signal 9)", or "still running".
  std::string describe() const;
};

namespace detail {

/// "SIGKILL" for 9, and so on; "signal N" for the rare ones.
inline std::string signal_name(int signal) {
  static const std::pair<int, const char*> names[] = {
      {SIGHUP, "SIGHUP"},   {SIGINT, "SIGINT"},   {SIGQUIT, "SIGQUIT"}, {SIGILL, "SIGILL"},
      {SIGTRAP, "SIGTRAP"}, {SIGABRT, "SIGABRT"}, {SIGBUS, "SIGBUS"},   {SIGFPE, "SIGFPE"},
      {SIGKILL, "SIGKILL"}, {SIGUSR1, "SIGUSR1"}, {SIGSEGV, "SIGSEGV"}, {SIGUSR2, "SIGUSR2"},
      {SIGPIPE, "SIGPIPE"}, {SIGALRM, "SIGALRM"}, {SIGTERM, "SIGTERM"}, {SIGXCPU, "SIGXCPU"},
      {SIGXFSZ, "SIGXFSZ"}, {SIGSYS, "SIGSYS"}};
  for (const auto& [number, name] : names) {
    if (number == signal) return name;
  }
  return "signal " + std::to_string(signal);
}

/// This process's argv as the kernel recorded it (NUL-terminated strings; empty ones kept).
inline std::vector<std::string> read_own_cmdline() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> argv;
  std::size_t begin = 0;
  for (std::size_t end; (end = all.find('\0', begin)) != std::string::npos; begin = end + 1) {
    argv.push_back(all.substr(begin, end - begin));
  }
  TRAINLOOP_CHECK(!argv.empty(), "/proc/self/cmdline is empty; expected this process's argv");
  return argv;
}

/// The last `max_chars` characters of a file (from a line start when possible); "" if absent.
inline std::string read_tail(const std::filesystem::path& path, std::size_t max_chars = 4000) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (text.size() > max_chars) {
    text = text.substr(text.size() - max_chars);
    if (auto newline = text.find('\n'); newline != std::string::npos) text = text.substr(newline + 1);
    text = "..." + text;
  }
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.pop_back();
  return text;
}

/// Set from a signal handler while launch() runs; the watch loop polls it.
inline volatile std::sig_atomic_t launcher_interrupt = 0;
inline void record_launcher_interrupt(int signal) { launcher_interrupt = signal; }

/// Installs record_launcher_interrupt for SIGINT, SIGTERM and SIGHUP (except those the process
/// ignores, e.g. under nohup) and puts the previous dispositions back on restore().
class InterruptGuard {
 public:
  InterruptGuard() {
    launcher_interrupt = 0;
    for (std::size_t i = 0; i < std::size(kSignals); ++i) {
      struct sigaction ours {};
      ours.sa_handler = record_launcher_interrupt;
      sigemptyset(&ours.sa_mask);
      ::sigaction(kSignals[i], nullptr, &previous_[i]);
      installed_[i] = previous_[i].sa_handler != SIG_IGN;
      if (installed_[i]) ::sigaction(kSignals[i], &ours, nullptr);
    }
  }
  InterruptGuard(const InterruptGuard&) = delete;
  InterruptGuard& operator=(const InterruptGuard&) = delete;
  ~InterruptGuard() { restore(); }
  void restore() {
    for (std::size_t i = 0; i < std::size(kSignals); ++i) {
      if (installed_[i]) ::sigaction(kSignals[i], &previous_[i], nullptr);
      installed_[i] = false;
    }
  }

 private:
  static constexpr int kSignals[] = {SIGINT, SIGTERM, SIGHUP};
  struct sigaction previous_[3] {};
  bool installed_[3] = {false, false, false};
};

}  // namespace detail

inline std::string RankProcess::describe() const {
  if (!exited) return "still running";
  if (signal != 0) return "killed by " + detail::signal_name(signal) + " (signal " + std::to_string(signal) + ")";
  if (exit_code < 0) return "ended with an unknown status (it was reaped by someone else)";
  return "exit code " + std::to_string(exit_code);
}

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
  /// @throws trainloop::Error when a rank exits non-zero or is killed by a signal, after every
  ///         other rank was stopped and reaped; the message names the rank, how it ended and
  ///         the tail of its `<run_dir>/rank<N>.error` (or of its log with log_to_files).
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
  std::vector<std::string> child_environment(int local_rank) const;
  void spawn(RankProcess& process, const std::vector<std::string>& argv);
  bool reap(RankProcess& process, bool block);
  void stop_all();
  void remove_run_dir() noexcept;
  void order_by_first_failure(std::vector<const RankProcess*>& failed) const;
  [[noreturn]] void throw_failure(const std::vector<const RankProcess*>& failed) const;

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
  const char* tmp = std::getenv("TMPDIR");
  std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/trainloop-run-XXXXXX";
  TRAINLOOP_CHECK(::mkdtemp(pattern.data()) != nullptr, "cannot create a run directory from ",
                  pattern, ": ", std::strerror(errno), "; expected a writable TMPDIR or /tmp");
  run_dir_ = pattern;
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
}

inline std::vector<std::string> Launcher::child_environment(int local_rank) const {
  const auto& o = options_;
  EnvVars overrides;
  if (auto threads = omp_num_threads_for_children(o.nprocs())) overrides["OMP_NUM_THREADS"] = *threads;
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

  std::vector<std::string> entries;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    std::string_view text(*entry);
    if (!overrides.count(std::string(text.substr(0, text.find('='))))) entries.emplace_back(text);
  }
  for (const auto& [name, value] : overrides) entries.push_back(name + "=" + value);
  return entries;
}

inline void Launcher::spawn(RankProcess& process, const std::vector<std::string>& argv) {
  std::vector<std::string> environment = child_environment(process.local_rank);
  std::vector<char*> argv_pointers, env_pointers;
  for (const auto& arg : argv) argv_pointers.push_back(const_cast<char*>(arg.c_str()));
  argv_pointers.push_back(nullptr);
  for (const auto& entry : environment) env_pointers.push_back(const_cast<char*>(entry.c_str()));
  env_pointers.push_back(nullptr);

  // Children start with no blocked signals and SIGTERM at its default action, whatever the
  // launching thread had, so that the launcher's SIGTERM always stops them.
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  sigset_t none, term;
  sigemptyset(&none);
  sigemptyset(&term);
  sigaddset(&term, SIGTERM);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setsigdefault(&attributes, &term);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  const std::string log = run_dir_ + "/rank" + std::to_string(process.rank) + ".log";
  if (options_.log_to_files()) {
    posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
  }
  process.started = std::chrono::steady_clock::now();
  int status = ::posix_spawn(&process.pid, options_.executable().c_str(), &files, &attributes,
                             argv_pointers.data(), env_pointers.data());
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attributes);
  TRAINLOOP_CHECK(status == 0, "cannot start rank ", process.rank, " (", options_.executable(),
                  "): ", std::strerror(status), "; expected an executable program");
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
  if (result < 0) return true;  // ECHILD: reaped elsewhere (SIGCHLD ignored?); status unknown
  if (WIFEXITED(status)) process.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) process.signal = WTERMSIG(status);
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
  for (int local_rank = 0; local_rank < options_.nprocs(); ++local_rank) {
    RankProcess process;
    process.local_rank = local_rank;
    process.rank = options_.node_rank() * options_.nprocs() + local_rank;
    ranks_.push_back(process);
    try {
      spawn(ranks_.back(), argv);
    } catch (...) {
      ranks_.pop_back();
      stop_all();
      throw;
    }
  }
  while (true) {
    std::vector<const RankProcess*> failed;
    bool any_running = false;
    for (auto& process : ranks_) {
      if (reap(process, false) && !process.succeeded() && !process.stopped_by_launcher) {
        failed.push_back(&process);
      }
      any_running = any_running || process.running;
    }
    if (int signal = detail::launcher_interrupt; signal != 0) {
      stop_all();
      remove_run_dir();  // the default disposition ends the process: no destructor will run
      interrupts.restore();
      ::raise(signal);  // the caller's own disposition: by default this ends the process
      TRAINLOOP_CHECK(false, "launch interrupted by ", detail::signal_name(signal), "; all ",
                      ranks_.size(), " ranks were stopped");
    }
    if (!failed.empty()) {
      stop_all();  // ranks_ is not resized from here on, so `failed` stays valid
      order_by_first_failure(failed);
      throw_failure(failed);
    }
    if (!any_running) return ranks_;
    std::this_thread::sleep_for(options_.poll_interval());
  }
}

/// Several ranks seen failed in one poll: the one that wrote its error file first is most
/// likely the cause (the others failing in the collective it left), then ranks without a file
/// (crashes), lowest rank first.
inline void Launcher::order_by_first_failure(std::vector<const RankProcess*>& failed) const {
  auto written = [&](const RankProcess* process) {
    std::error_code missing;
    auto time = std::filesystem::last_write_time(rank_error_path(run_dir_, process->rank), missing);
    return std::make_pair(missing ? 1 : 0, missing ? std::filesystem::file_time_type() : time);
  };
  std::stable_sort(failed.begin(), failed.end(), [&](const RankProcess* a, const RankProcess* b) {
    return written(a) < written(b);
  });
}

inline void Launcher::throw_failure(const std::vector<const RankProcess*>& failed) const {
  const RankProcess& first = *failed.front();
  std::ostringstream message;
  message << "trainloop: rank " << first.rank << " (local rank " << first.local_rank << " on node "
          << options_.node_rank() << ", pid " << first.pid << ") failed: " << first.describe()
          << " after " << std::fixed << std::setprecision(2) << first.wall_seconds << " s";
  std::string error_text = detail::read_tail(rank_error_path(run_dir_, first.rank));
  if (!error_text.empty()) {
    message << "; its error:\n" << error_text;
  } else if (options_.log_to_files()) {
    const std::string log = run_dir_ + "/rank" + std::to_string(first.rank) + ".log";
    const std::string output = detail::read_tail(log, 2000);
    message << "; it left no error message; "
            << (output.empty() ? "its output (" + log + ") is empty"
                               : "the end of its output (" + log + "):\n" + output);
  } else {
    message << "; it left no error message (a crash or a signal, or an exception not reported "
               "with report_rank_failure)";
  }
  for (std::size_t i = 1; i < failed.size(); ++i) {
    message << "\nalso failed: rank " << failed[i]->rank << " (" << failed[i]->describe() << ")";
  }
  int stopped = 0;
  for (const auto& process : ranks_) stopped += process.stopped_by_launcher ? 1 : 0;
  if (stopped > 0) {
    message << "\nthe other " << stopped << " running rank(s) were stopped (SIGTERM, then "
            << "SIGKILL after " << options_.grace_period().count() << " ms)";
  }
  throw Error(message.str());
}

}  // namespace trainloop::dist
