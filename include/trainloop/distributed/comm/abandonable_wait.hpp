#pragma once
/// @file
/// @brief Waiting for a collective that may never complete: elastic training (distributed/
/// elastic/) abandons the collectives of a group that lost a rank instead of waiting out their
/// timeout. Gloo's operations cannot be aborted (its Backend::abort() does nothing in libtorch
/// 2.11 to 2.15), so the waiting thread stops waiting and the operation is left to its worker
/// thread, with the group it belongs to kept alive (distributed/elastic/regroup.hpp parks it).
///
/// While an abandon probe is installed, a wait that has not completed within one period asks the
/// probe, then again each period. The operation's completion wakes the wait at once (a callback
/// on its future), so a collective that completes costs no period: nothing is asked per step.

#include <trainloop/detail/torch_compat.hpp>

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

namespace trainloop::distributed {

/// Says whether this process's collectives are to be abandoned (a peer was lost); empty: never.
using AbandonProbe = std::function<bool()>;

namespace detail {

struct AbandonProbeSlot {
  std::mutex mutex;
  AbandonProbe probe;
};

inline AbandonProbeSlot& abandon_probe_slot() {
  static AbandonProbeSlot slot;
  return slot;
}

/// The probe installed now (a copy: it is called outside the lock).
inline AbandonProbe current_abandon_probe() {
  auto& slot = abandon_probe_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  return slot.probe;
}

}  // namespace detail

/// Installs `probe` for every later wait of this process (empty: waits block until the
/// collective completes or times out, as without elastic training).
inline void install_abandon_probe(AbandonProbe probe) {
  auto& slot = detail::abandon_probe_slot();
  std::lock_guard<std::mutex> lock(slot.mutex);
  slot.probe = std::move(probe);
}

/// How long a wait lasts before it first asks the probe, and between two asks (a store lookup
/// each; a rank notices a lost peer within about this long plus one lookup).
inline constexpr std::chrono::milliseconds kAbandonProbePeriod{50};

/// Waits until `work` completes (true) or `probe` says to abandon it (false: the work is left
/// running). Without a probe, blocks as work->wait() does. Errors of the work are not raised
/// here: the caller's work->wait() afterwards raises them.
inline bool wait_unless_abandoned(const ::trainloop::detail::WorkHandle& work, const AbandonProbe& probe) {
  if (!probe || work->isCompleted()) return true;
  struct Signal {
    std::mutex mutex;
    std::condition_variable changed;
    bool done = false;
  };
  auto signal = std::make_shared<Signal>();
  try {
    // The callback may run after an abandoned wait returned: it holds the signal, not the frame.
    work->getFuture()->addCallback([signal](c10::ivalue::Future&) {
      {
        std::lock_guard<std::mutex> lock(signal->mutex);
        signal->done = true;
      }
      signal->changed.notify_all();
    });
  } catch (const std::exception&) {
    // A work without a future: polled each period instead.
  }
  std::unique_lock<std::mutex> lock(signal->mutex);
  while (!signal->done && !work->isCompleted()) {
    if (signal->changed.wait_for(lock, kAbandonProbePeriod, [&] { return signal->done; })) break;
    if (work->isCompleted()) break;
    lock.unlock();
    const bool abandon = probe();
    lock.lock();
    if (abandon) return false;
  }
  return true;
}

}  // namespace trainloop::distributed
