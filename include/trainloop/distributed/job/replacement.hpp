#pragma once
/// @file
/// @brief Whether this process is a replacement still waiting to join (elastic training): trainloop's
/// launcher starts a process in place of a lost rank (distributed/launch/launcher.hpp) with
/// TRAINLOOP_REPLACEMENT set. It runs the program from main() as every rank does, but the job's group
/// formed long ago: it has none until the survivors admit it at a step boundary of the running fit
/// (distributed/elastic/admission.hpp). Until then barrier() and rank0_first() do not wait for the
/// others (what they guard — a download, a cache — was done before it started), and the engine
/// joins no group before its fit.

#include <trainloop/distributed/job/rank_env.hpp>

#include <atomic>
#include <cstdlib>
#include <exception>

namespace trainloop::distributed {

/// True in a replacement process until the survivors admitted it (then false for good).
inline std::atomic<bool>& awaiting_admission() {
  static std::atomic<bool> waiting{[] {
    const char* value = std::getenv(env_names::replacement);
    return value != nullptr && *value != '\0';
  }()};
  return waiting;
}

/// Thrown in a replacement whose fit ended before the survivors admitted it (the fit's last steps
/// passed while it started): it has nothing to do, and its process ends with success.
class FitEndedBeforeAdmission : public std::exception {
 public:
  /// What happened.
  const char* what() const noexcept override {
    return "trainloop: the fit ended before this replacement was admitted; it ends without training";
  }
};

}  // namespace trainloop::distributed
