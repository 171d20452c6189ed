#pragma once
/// @file
/// @brief The POSIX process plumbing of the launcher: signal names, this process's argv, starting
/// a process, whether a process still lives, and scoped changes to signal dispositions while ranks run.

#include <trainloop/detail/format.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/error.hpp>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <spawn.h>
#include <sstream>
#include <string>
#include <sys/types.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace trainloop::distributed::detail {

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
  if (argv.empty()) throw Error("trainloop: /proc/self/cmdline is empty; expected this process's argv");
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

// Whether a process still lives: shared with the removal of dead writers' temporary files.
using ::trainloop::detail::process_alive;
using ::trainloop::detail::process_start_time;

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
  /// Puts the caller's dispositions back (idempotent).
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

/// While alive, lets this process reap its own children. A program that set SIGCHLD to SIG_IGN
/// (or SA_NOCLDWAIT) has its children reaped by the kernel, so waitpid() could never learn how a
/// rank ended and a successful job looked like ranks "reaped by someone else". The disposition
/// is put back afterwards. (The SIGCHLD disposition is process-wide: another thread's children
/// are not auto-reaped meanwhile either.)
class ReapOwnChildrenGuard {
 public:
  ReapOwnChildrenGuard() {
    ::sigaction(SIGCHLD, nullptr, &previous_);
    changed_ = previous_.sa_handler == SIG_IGN || (previous_.sa_flags & SA_NOCLDWAIT) != 0;
    if (changed_) {
      struct sigaction reap_ourselves {};
      reap_ourselves.sa_handler = SIG_DFL;
      sigemptyset(&reap_ourselves.sa_mask);
      ::sigaction(SIGCHLD, &reap_ourselves, nullptr);
    }
  }
  ReapOwnChildrenGuard(const ReapOwnChildrenGuard&) = delete;
  ReapOwnChildrenGuard& operator=(const ReapOwnChildrenGuard&) = delete;
  ~ReapOwnChildrenGuard() {
    if (changed_) ::sigaction(SIGCHLD, &previous_, nullptr);
  }

 private:
  struct sigaction previous_ {};
  bool changed_ = false;
};

}  // namespace trainloop::distributed::detail

namespace trainloop::distributed::detail {

/// Starts `executable` with `argv` and `environment` ("NAME=value" each), its stdout and stderr to
/// `log` unless that is empty (appended to with `append_log`). The child starts with no blocked
/// signals and SIGTERM at its default action whatever the calling thread has, so that the
/// launcher's SIGTERM always stops it. @return its pid.
/// @throws trainloop::ConfigurationError when `executable` cannot be run, trainloop::Error when the
///         system cannot start a process; both name `what` (the rank it was to be).
inline pid_t spawn_process(const std::string& executable, const std::vector<std::string>& argv,
                           const std::vector<std::string>& environment, const std::string& log, bool append_log,
                           const std::string& what) {
  std::vector<char*> argv_pointers, env_pointers;
  for (const auto& arg : argv) argv_pointers.push_back(const_cast<char*>(arg.c_str()));
  argv_pointers.push_back(nullptr);
  for (const auto& entry : environment) env_pointers.push_back(const_cast<char*>(entry.c_str()));
  env_pointers.push_back(nullptr);
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
  if (!log.empty()) {
    posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(), O_WRONLY | O_CREAT | (append_log ? O_APPEND : O_TRUNC), 0644);
    posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
  }
  pid_t pid = -1;
  const int status = ::posix_spawn(&pid, executable.c_str(), &files, &attributes, argv_pointers.data(), env_pointers.data());
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attributes);
  if (status == ENOENT || status == EACCES || status == ENOEXEC) {
    TRAINLOOP_CHECK(false, "cannot start ", what, " (", executable, "): ", std::strerror(status), "; expected an executable program");
  }
  if (status != 0) {
    throw Error(::trainloop::detail::concat("trainloop: cannot start ", what, " (", executable, "): ", std::strerror(status),
                                            "; the system is out of processes or memory"));
  }
  return pid;
}

}  // namespace trainloop::distributed::detail

namespace trainloop::distributed {

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
  bool lost = false;                    ///< elastic training: it ended and the other ranks went on
  /// Elastic training: 0 for the first process of its rank, n for its n-th replacement (1 for the
  /// first processes of a machine that stands in for a lost one: LaunchOptions::joins_running_fit).
  int replacement = 0;
  double wall_seconds = 0.0;            ///< spawn to reap
  std::chrono::steady_clock::time_point started{};  ///< when it was spawned

  /// True when the rank exited with status 0 (and, with require_completion, completed its work).
  bool succeeded() const { return exited && signal == 0 && exit_code == 0 && !ended_early; }
  bool ended_early = false;             ///< exited 0 without reporting completion (require_completion)
  /// "exit code 1", "killed by SIGKILL (signal 9)", or "still running".
  std::string describe() const;
};

inline std::string RankProcess::describe() const {
  if (!exited) return "still running";
  if (signal != 0) return "killed by " + detail::signal_name(signal) + " (signal " + std::to_string(signal) + ")";
  if (ended_early) return "exited with status 0 before its work was done (did the program call exit() while training?)";
  if (exit_code < 0) return "ended with an unknown status (it was reaped by someone else)";
  return "exit code " + std::to_string(exit_code);
}

}  // namespace trainloop::distributed
