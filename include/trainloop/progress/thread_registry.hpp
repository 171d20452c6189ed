#pragma once
/// @file
/// @brief trainloop::progress::ThreadRegistry: the threads of this process whose stacks a stall
/// report shows — the training thread (the one that called fit) and the loader's workers — by
/// their kernel thread ids, which is what a signal needs to reach one thread (thread_stack.hpp).

#include <atomic>
#include <cstddef>
#include <string>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>
#include <vector>

namespace trainloop::progress {

/// This thread's kernel id (what /proc and tgkill use).
inline pid_t current_thread_id() { return static_cast<pid_t>(::syscall(SYS_gettid)); }

/// A fixed table of registered threads: registering and reading take no lock (a stall report
/// reads it while the threads it lists may be stuck holding any lock).
class ThreadRegistry {
 public:
  /// Threads that can be registered at once (the training thread and up to 15 loader workers).
  static constexpr std::size_t kSlots = 16;

  /// A registered thread.
  struct Entry {
    pid_t tid = 0;            ///< kernel thread id
    std::string role;         ///< "training thread", "loader worker 2"
  };

  /// Registers the calling thread as `role` (a string literal) number `index` (-1: none); returns
  /// its slot, or -1 when the table is full (the thread is then not shown).
  int add(const char* role, int index = -1) {
    const pid_t tid = current_thread_id();
    for (std::size_t slot = 0; slot < kSlots; ++slot) {
      pid_t expected = 0;
      if (slots_[slot].tid.compare_exchange_strong(expected, tid)) {
        slots_[slot].role.store(role);
        slots_[slot].index.store(index);
        return static_cast<int>(slot);
      }
    }
    return -1;
  }
  /// Frees the slot add() returned.
  void remove(int slot) {
    if (slot >= 0 && static_cast<std::size_t>(slot) < kSlots) slots_[static_cast<std::size_t>(slot)].tid.store(0);
  }
  /// The threads registered now.
  std::vector<Entry> list() const {
    std::vector<Entry> entries;
    for (const auto& slot : slots_) {
      const pid_t tid = slot.tid.load();
      if (tid == 0) continue;
      Entry entry;
      entry.tid = tid;
      const char* role = slot.role.load();
      entry.role = role != nullptr ? role : "thread";
      if (const int index = slot.index.load(); index >= 0) entry.role += " " + std::to_string(index);
      entries.push_back(std::move(entry));
    }
    return entries;
  }

 private:
  struct Slot {
    std::atomic<pid_t> tid{0};
    std::atomic<const char*> role{nullptr};
    std::atomic<int> index{-1};
  };
  Slot slots_[kSlots];
};

/// Registers the calling thread for its scope.
class RegisteredThread {
 public:
  /// Registers in `registry` as `role` (a string literal) number `index`.
  RegisteredThread(ThreadRegistry& registry, const char* role, int index = -1)
      : registry_(registry), slot_(registry.add(role, index)) {}
  RegisteredThread(const RegisteredThread&) = delete;
  RegisteredThread& operator=(const RegisteredThread&) = delete;
  ~RegisteredThread() { registry_.remove(slot_); }

 private:
  ThreadRegistry& registry_;
  int slot_;
};

}  // namespace trainloop::progress
