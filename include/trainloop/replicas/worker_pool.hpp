#pragma once
/// @file
/// @brief WorkerPool: a fixed set of persistent threads, one per replica, that run one job each
/// per call and report every job's exception to the caller.
///
/// gpu_mode::DataParallel hands every micro-batch to its replicas through this pool. Threads are
/// started once (not per batch, unlike PyTorch's parallel_apply) and woken through one
/// mutex/condition variable; run() returns only after every job of the call has finished, so the
/// caller never races a worker, and the destructor stops and joins every thread.

#include <trainloop/error.hpp>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace trainloop::detail {

/// Persistent worker threads; `run(n, job)` calls `job(i)` on worker i for every i < n.
class WorkerPool {
 public:
  /// @brief Starts `workers` threads.
  /// @param workers number of job slots (indices 0 .. workers-1)
  /// @param caller_runs_first when true, job index 0 runs on the thread that calls run() and only
  ///        `workers - 1` threads are started (saves one hand-off per call)
  explicit WorkerPool(size_t workers, bool caller_runs_first = false)
      : slots_(workers), first_thread_slot_(caller_runs_first ? 1 : 0) {
    TRAINLOOP_CHECK(workers >= 1, "a worker pool of ", workers, " workers was asked for; expected at least 1");
    try {
      for (size_t slot = first_thread_slot_; slot < slots_; ++slot) threads_.emplace_back([this, slot] { work(slot); });
    } catch (...) {
      stop_and_join();  // a thread that could not start must not leave the others running
      throw;
    }
  }

  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  /// Stops and joins every thread (none is running a job: run() waits for its jobs).
  ~WorkerPool() { stop_and_join(); }

  /// Number of job slots.
  size_t size() const { return slots_; }
  /// Number of threads the pool started (size(), or size() - 1 when the caller runs slot 0).
  size_t thread_count() const { return threads_.size(); }

  /// @brief Runs `job(i)` for every i < `active` on worker i, concurrently, and waits for all.
  /// @return one entry per slot: the exception job i threw, or null (also for slots >= active).
  std::vector<std::exception_ptr> run(size_t active, const std::function<void(size_t)>& job) {
    TRAINLOOP_CHECK(active <= slots_, "run() was asked for ", active, " jobs on a pool of ", slots_, " workers");
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      active_ = active;
      errors_.assign(slots_, nullptr);
      pending_ = active > first_thread_slot_ ? active - first_thread_slot_ : 0;
      ++generation_;
    }
    wake_.notify_all();
    std::exception_ptr caller_error;
    if (first_thread_slot_ == 1 && active > 0) {
      try {
        job(0);
      } catch (...) {
        caller_error = std::current_exception();
      }
    }
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return pending_ == 0; });
    job_ = nullptr;
    if (caller_error) errors_[0] = caller_error;
    return errors_;
  }

 private:
  void work(size_t slot) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(size_t)>* job = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || generation_ != seen; });
        if (stopping_) return;
        seen = generation_;
        if (slot >= active_) continue;  // this call needs fewer workers than the pool has
        job = job_;
      }
      std::exception_ptr error;
      try {
        (*job)(slot);
      } catch (...) {
        error = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex_);
      errors_[slot] = error;
      if (--pending_ == 0) done_.notify_one();
    }
  }

  void stop_and_join() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    for (auto& thread : threads_)
      if (thread.joinable()) thread.join();
  }

  const size_t slots_;
  const size_t first_thread_slot_;
  std::mutex mutex_;
  std::condition_variable wake_;  // workers wait here for a new generation (or stop)
  std::condition_variable done_;  // run() waits here for pending_ == 0
  const std::function<void(size_t)>* job_ = nullptr;
  size_t active_ = 0;
  size_t pending_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
  std::vector<std::exception_ptr> errors_;
  std::vector<std::thread> threads_;
};

}  // namespace trainloop::detail
