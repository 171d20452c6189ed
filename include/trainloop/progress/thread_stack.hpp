#pragma once
/// @file
/// @brief The C++ stack of another thread of this process, symbolized: what a stall report shows
/// of a stuck rank (where its training thread is, down to the user's own functions).
///
/// How: the watchdog sends the thread a real-time signal (tgkill); the handler records its
/// return addresses with glibc's backtrace() (async-signal-safe once its unwinder is loaded,
/// which install_stack_capture() does) and the watchdog turns them into names with dladdr() and
/// the C++ ABI's demangler (libraries' frames: dladdr sees their exported symbols), and the
/// program's own frames with binutils' addr2line when it is installed, which reads the program's
/// full symbol table (static functions and anonymous namespaces too; file:line with -g). A
/// stripped program without -rdynamic shows addresses. No library does this from another thread
/// (c10::get_backtrace() and libunwind see only the calling thread), hence this file.
///
/// A thread in uninterruptible sleep (a read from a dead NFS server) or with the signal blocked
/// does not answer: the report then says so instead of a stack.

#include <trainloop/detail/type_name.hpp>
#include <trainloop/progress/thread_registry.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dlfcn.h>
#include <execinfo.h>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <sys/syscall.h>
#include <thread>
#include <unistd.h>
#include <vector>

namespace trainloop::progress {

namespace detail {

inline constexpr int kMaxFrames = 64;

struct StackRequest {
  std::atomic<int> state{0};  // 0 idle, 1 asked, 3 being written, 2 answered
  std::atomic<pid_t> target{0};  // the thread asked: a late signal to another one is ignored
  void* frames[kMaxFrames] = {};
  int count = 0;
};

inline StackRequest& stack_request() {
  static StackRequest request;
  return request;
}

/// The signal: a real-time one, which nothing in libtorch, Gloo or NCCL uses.
inline int stack_signal() { return SIGRTMIN + 5; }

inline void record_stack(int) {
  StackRequest& request = stack_request();
  const int saved_errno = errno;
  // Only the thread asked, only while asked (a signal that arrives after its capture timed out
  // finds another request or none), and only once: the state goes 1 -> 3 -> 2.
  int asked = 1;
  if (static_cast<pid_t>(::syscall(SYS_gettid)) == request.target.load(std::memory_order_acquire) &&
      request.state.compare_exchange_strong(asked, 3, std::memory_order_acq_rel)) {
    request.count = ::backtrace(request.frames, kMaxFrames);
    request.state.store(2, std::memory_order_release);
  }
  errno = saved_errno;
}

inline std::string base_name(const char* path) {
  if (path == nullptr) return "?";
  const char* slash = std::strrchr(path, '/');
  return slash != nullptr ? slash + 1 : path;
}

/// Names of `offsets` in `file` by binutils' addr2line (function, then file:line, per address);
/// empty when it is not installed or fails.
inline std::vector<std::pair<std::string, std::string>> addr2line(const std::string& file,
                                                                  const std::vector<std::uintptr_t>& offsets) {
  std::vector<std::pair<std::string, std::string>> names;
  if (offsets.empty() || file.find_first_of("'\\") != std::string::npos) return names;
  std::string command = "addr2line -f -C -e '" + file + "'";
  char hex[32];
  for (std::uintptr_t offset : offsets) {
    std::snprintf(hex, sizeof hex, " 0x%zx", static_cast<std::size_t>(offset));
    command += hex;
  }
  command += " 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return names;
  std::vector<std::string> lines;
  char buffer[4096];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) {
    std::string line(buffer);
    while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
    lines.push_back(line);
  }
  ::pclose(pipe);
  for (std::size_t i = 0; i + 1 < lines.size(); i += 2) names.emplace_back(lines[i], lines[i + 1]);
  if (names.size() != offsets.size()) names.clear();
  return names;
}

}  // namespace detail

/// Installs the signal handler that records a thread's stack (once per process; later calls do
/// nothing). Returns false when the signal is taken by a handler of the program's own.
inline bool install_stack_capture() {
  static const bool installed = [] {
    void* warm[2];
    ::backtrace(warm, 2);  // loads libgcc's unwinder now, never inside the handler
    struct sigaction existing {};
    if (::sigaction(detail::stack_signal(), nullptr, &existing) == 0 && existing.sa_handler != SIG_DFL &&
        existing.sa_handler != SIG_IGN && existing.sa_handler != &detail::record_stack) {
      return false;
    }
    struct sigaction action {};
    action.sa_handler = &detail::record_stack;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART;
    return ::sigaction(detail::stack_signal(), &action, nullptr) == 0;
  }();
  return installed;
}

/// The return addresses of thread `tid`'s stack, innermost first (the handler's own frames
/// dropped); nothing when it did not answer within `timeout`.
inline std::optional<std::vector<void*>> capture_thread_stack(pid_t tid, std::chrono::milliseconds timeout) {
  static std::mutex one_at_a_time;
  std::lock_guard<std::mutex> lock(one_at_a_time);
  if (!install_stack_capture()) return std::nullopt;
  detail::StackRequest& request = detail::stack_request();
  request.count = 0;
  request.target.store(tid, std::memory_order_release);
  request.state.store(1, std::memory_order_release);
  if (::syscall(SYS_tgkill, ::getpid(), tid, detail::stack_signal()) != 0) {
    request.state.store(0);
    return std::nullopt;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (request.state.load(std::memory_order_acquire) != 2) {
    int asked = 1;
    // Give up only while the handler has not started writing (1 -> 0); once it writes, it finishes.
    if (std::chrono::steady_clock::now() >= deadline && request.state.compare_exchange_strong(asked, 0)) {
      return std::nullopt;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  // Frame 0 is the handler, frame 1 the kernel's signal trampoline: the thread was at frame 2.
  std::vector<void*> frames;
  for (int i = 2; i < request.count; ++i) frames.push_back(request.frames[i]);
  request.state.store(0);
  return frames;
}

/// One line per frame: "name (library)". Libraries' frames are named by dladdr (their exported
/// symbols); the program's own by addr2line when installed (it reads the full symbol table, which
/// dladdr does not: without -rdynamic it would give the nearest exported symbol, a wrong name),
/// else by dladdr; "library+0xoffset" when nothing names the frame.
inline std::vector<std::string> symbolize_stack(const std::vector<void*>& frames) {
  struct Frame {
    std::string name, file, path, where;
    std::uintptr_t offset = 0;
  };
  std::vector<Frame> resolved(frames.size());
  std::map<std::string, std::vector<std::size_t>> unnamed_by_file;
  // This header's functions are compiled into the program (or the library) that includes it:
  // frames at that base are the program's, read through /proc/<pid>/exe (dladdr names it by
  // argv[0], which may be relative to another directory; /proc/self would be addr2line's own).
  Dl_info own{};
  const void* own_base = ::dladdr(reinterpret_cast<void*>(&detail::record_stack), &own) != 0 ? own.dli_fbase : nullptr;
  const std::string program = "/proc/" + std::to_string(::getpid()) + "/exe";
  for (std::size_t i = 0; i < frames.size(); ++i) {
    // A return address points after its call; the call itself is one byte before (the
    // interrupted frame, i == 0, is exact).
    const auto address = reinterpret_cast<std::uintptr_t>(frames[i]) - (i == 0 ? 0 : 1);
    Dl_info info{};
    Frame& frame = resolved[i];
    if (::dladdr(reinterpret_cast<void*>(address), &info) == 0) {
      char text[32];
      std::snprintf(text, sizeof text, "0x%zx", static_cast<std::size_t>(address));
      frame.name = text;
      continue;
    }
    frame.file = detail::base_name(info.dli_fname);
    frame.path = info.dli_fbase == own_base ? program : (info.dli_fname != nullptr ? info.dli_fname : "");
    frame.offset = address - reinterpret_cast<std::uintptr_t>(info.dli_fbase);
    if (info.dli_sname != nullptr) frame.name = ::trainloop::detail::demangled(info.dli_sname);
    // The program's frames go to addr2line (over libtorch it would take longer than a report may).
    if (frame.path == program) unnamed_by_file[frame.path].push_back(i);
  }
  for (const auto& [path, indices] : unnamed_by_file) {
    std::vector<std::uintptr_t> offsets;
    for (std::size_t i : indices) offsets.push_back(resolved[i].offset);
    const auto names = detail::addr2line(path, offsets);
    for (std::size_t k = 0; k < names.size(); ++k) {
      Frame& frame = resolved[indices[k]];
      if (names[k].first != "??") frame.name = names[k].first;
      if (names[k].second.rfind("??", 0) != 0) frame.where = names[k].second;
    }
  }
  std::vector<std::string> lines;
  for (const Frame& frame : resolved) {
    std::string line = frame.name;
    if (line.empty()) {
      char text[64];
      std::snprintf(text, sizeof text, "+0x%zx", static_cast<std::size_t>(frame.offset));
      line = frame.file + text;
    } else if (!frame.file.empty()) {
      line += " (" + (frame.where.empty() ? frame.file : frame.where) + ")";
    }
    if (line.size() > 300) line = line.substr(0, 297) + "...";
    lines.push_back(std::move(line));
  }
  return lines;
}

}  // namespace trainloop::progress
