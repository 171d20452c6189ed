#pragma once
// Ranks as threads of one test process, each with its own store client and Gloo backend: the
// quickest way to run real collectives in a unit test.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/launch/free_port.hpp>

#include <chrono>
#include <cstdlib>
#include <exception>
#include <functional>
#include <thread>
#include <vector>

/// Options for thread-rank `rank` of `world_size` on loopback at `port`, with a short timeout.
inline trainloop::distributed::ProcessGroupOptions thread_rank_options(int rank, int world_size, int port) {
  trainloop::distributed::ProcessGroupOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.master_port = port;
  options.backend = trainloop::distributed::Backend::Gloo;
  options.timeout = std::chrono::seconds(10);
  return options;
}

/// Runs `body(group)` on `world_size` thread-ranks; returns each rank's exception (null when it
/// succeeded).
inline std::vector<std::exception_ptr> run_ranks_collecting(
    int world_size, const std::function<void(trainloop::distributed::ProcessGroup&)>& body) {
  // libtorch 2.11's c10d flight recorder (one per process, shared by every process group) adds a
  // group to its status map before taking its mutex (FlightRecorderDetail.hpp, recordWithResetEnabled):
  // two thread-ranks enqueueing their first collectives at once corrupted the map (SIGSEGV in
  // test_gradient_reducer). One rank per process, as trainloop runs them, never meets it; here
  // the recorder is switched off before the first group reads its size (0 entries: disabled).
  ::setenv("TORCH_FR_BUFFER_SIZE", "0", /*overwrite=*/0);
  const int port = trainloop::distributed::find_free_port();
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto group = trainloop::distributed::ProcessGroup::create(thread_rank_options(rank, world_size, port));
        body(group);
      } catch (...) {
        errors[rank] = std::current_exception();
      }
    });
  }
  for (auto& thread : threads) thread.join();
  return errors;
}

/// Runs `body(group)` on `world_size` thread-ranks; rethrows the first failing rank's exception.
inline void run_ranks(int world_size, const std::function<void(trainloop::distributed::ProcessGroup&)>& body) {
  for (auto& error : run_ranks_collecting(world_size, body)) {
    if (error) std::rethrow_exception(error);
  }
}

#include <mutex>

/// Boost.Test's checks are not thread-safe, and thread-ranks check concurrently (two unguarded
/// BOOST_TESTs at once have corrupted its state: a std::length_error in a passing test).
inline std::mutex& test_check_mutex() {
  static std::mutex mutex;
  return mutex;
}
/// BOOST_TEST, serialised across thread-ranks.
#define RANK_TEST(...)                                          \
  do {                                                          \
    std::lock_guard<std::mutex> rank_test_lock(test_check_mutex()); \
    BOOST_TEST(__VA_ARGS__);                                    \
  } while (false)
