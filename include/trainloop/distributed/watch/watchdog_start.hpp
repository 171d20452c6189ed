#pragma once
/// @file
/// @brief Starting this process's stall watchdog (stall_watchdog.hpp) once, and starting it again
/// for the new group after a lost rank's survivors regrouped (elastic training).

#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/distributed/watch/stall_watchdog.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <cstdio>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

namespace trainloop::distributed {

namespace detail {

/// The process's watchdog and the options of the first start (one watchdog watches a process).
struct WatchdogSlot {
  std::mutex mutex;
  std::optional<StallWatchOptions> started;  // the first call's, whether it started one
  std::unique_ptr<StallWatchdog> watchdog;
  bool warned = false;
};

inline WatchdogSlot& watchdog_slot() {
  static WatchdogSlot slot;
  return slot;
}

}  // namespace detail

/// Starts this rank's watchdog once per process: options from the mode, overridden by the
/// environment (stall_options.hpp), checked against the collective timeout. Does nothing when
/// they turn it off. A later call (another loop's fit in the same process) keeps the first
/// watchdog, and says once on stderr when its options differ (one watchdog per process: the
/// store's records are the process's).
inline void start_stall_watchdog(const ProcessGroupOptions& group_options, const RankEnv& env,
                                 const StallWatchOptions& mode_options) {
  auto& slot = detail::watchdog_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  const StallWatchOptions options = stall_options_from_environment(mode_options);
  if (slot.started) {
    if (!same_stall_options(*slot.started, options) && !std::exchange(slot.warned, true)) {
      std::fprintf(stderr, "trainloop: rank %d's stall watchdog keeps its first options (%s); this fit's (%s) are not "
                   "used: one watchdog watches a process\n", env.rank, stall_options_words(*slot.started).c_str(),
                   stall_options_words(options).c_str());
    }
    return;
  }
  options.validate(group_options.timeout);
  slot.started = options;
  if (!options.enabled) return;
  slot.watchdog = std::make_unique<StallWatchdog>(group_options, env, options);
}

/// After the survivors of a lost rank regrouped (elastic training): the watchdog of the old group
/// stops, the collective log numbers from 1, and, if one was running, a watchdog with the same
/// options watches the new group (its rank, world size and store prefix in `group_options`).
inline void restart_stall_watchdog(const ProcessGroupOptions& group_options, const RankEnv& env) {
  auto& slot = detail::watchdog_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  const bool running = slot.watchdog != nullptr;
  slot.watchdog.reset();  // joins its thread: it reads the old group's records no more
  progress::progress_beacon().collectives().restart();
  if (running) slot.watchdog = std::make_unique<StallWatchdog>(group_options, env, *slot.started);
}

}  // namespace trainloop::distributed
