#pragma once
/// @file
/// @brief trainloop::distributed::StallWatchOptions: when the stall watchdog calls a rank stuck,
/// and what it does then — set on gpu_mode::DistributedDataParallel::stall_watch(), overridden by
/// the environment (TRAINLOOP_STALL_LIMIT, TRAINLOOP_STALL_ACTION, TRAINLOOP_STALL_CHECKPOINT_LIMIT).

#include <trainloop/detail/environment.hpp>
#include <trainloop/error.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <optional>
#include <string>

namespace trainloop::distributed {

/// What the watchdog does when a rank stalls or the ranks desync.
enum class StallAction {
  Fail,   ///< report, then end the job as for a failed rank (the default)
  Report  ///< report once per stall and keep waiting (the collective timeout stays the last resort)
};

/// When a rank counts as a straggler (straggler_watch.hpp; TRAINLOOP_STRAGGLER overrides): it
/// trails the others' own time per step (collective waits left out) by at least `least_excess` and
/// `least_fraction` of theirs in `readings` readings in a row (one a watchdog period, 0.2 s here).
/// Chosen from measurements on clean runs (docs/modes-and-launching.md, "A rank that is slow").
struct StragglerOptions {
  bool enabled = true;                                   ///< false: nobody is named
  std::chrono::milliseconds least_excess{25};            ///< a straggler trails by at least this per step...
  double least_fraction = 0.2;                           ///< ...and by this fraction of the others' time per step
  int readings = 3;                                      ///< in this many readings in a row
  std::chrono::seconds repeat_after{60};                 ///< named again at most this often while it lasts
};

/// When a rank counts as stalled: no progress for limit_for() seconds while another rank waits
/// for it. The defaults suit long jobs: 60 s, or 10 times the slowest step if that is longer,
/// five times that until 2 steps have completed (compiling, allocating, warming caches), and 5
/// minutes in a checkpoint's write or read — each below 90% of the collective timeout, which stays
/// the last resort.
struct StallWatchOptions {
  /// The default of `limit`.
  static constexpr std::chrono::milliseconds kDefaultLimit{60000};
  bool enabled = true;                                      ///< false: no watchdog at all
  std::chrono::milliseconds limit = kDefaultLimit;          ///< the least time without progress that is a stall
  double step_factor = 10.0;                                ///< the limit grows to this many times the slowest step
  int grace_steps = 2;                                      ///< until this many steps completed, the limit is...
  double grace_factor = 5.0;                                ///< ...this many times longer
  std::chrono::milliseconds checkpoint_limit = std::chrono::minutes(5);  ///< the limit while a checkpoint is written or read
  StallAction action = StallAction::Fail;                   ///< what happens then
  StragglerOptions straggler = {};                          ///< when a slow (not stalled) rank is named

  /// The limit for a rank in its current phase, after `steps_timed` steps of which the slowest
  /// took `slowest_step` seconds, with collectives that time out after `timeout`.
  double limit_for(bool checkpoint_phase, long long steps_timed, double slowest_step,
                   std::chrono::milliseconds timeout) const {
    double seconds = std::max(to_seconds(limit), step_factor * slowest_step);
    if (steps_timed < grace_steps) seconds *= grace_factor;
    if (checkpoint_phase) seconds = std::max(seconds, to_seconds(checkpoint_limit));
    return std::min(seconds, 0.9 * to_seconds(timeout));
  }

  /// Checks the values against the collective timeout.
  /// @throws trainloop::ConfigurationError naming the first value out of range.
  void validate(std::chrono::milliseconds timeout) const {
    if (!enabled) return;
    TRAINLOOP_CHECK(limit.count() > 0, "the stall limit is ", limit.count(), " ms; expected > 0 (or the watchdog off)");
    // The default limit is capped at 90% of a shorter timeout (limit_for); one asked for is checked.
    TRAINLOOP_CHECK(limit < timeout || limit == kDefaultLimit, "the stall limit is ", limit.count(), " ms and the collective timeout ", timeout.count(),
                    " ms; expected a stall limit below the timeout (the timeout would end the job first, naming nobody)");
    TRAINLOOP_CHECK(std::isfinite(step_factor) && step_factor >= 1.0, "the stall limit's step factor is ", step_factor,
                    "; expected >= 1");
    TRAINLOOP_CHECK(std::isfinite(grace_factor) && grace_factor >= 1.0 && grace_steps >= 0, "the stall grace is ",
                    grace_steps, " steps x ", grace_factor, "; expected >= 0 steps and a factor >= 1");
    TRAINLOOP_CHECK(checkpoint_limit.count() > 0, "the checkpoint stall limit is ", checkpoint_limit.count(),
                    " ms; expected > 0");
  }

  /// `value` in seconds.
  static double to_seconds(std::chrono::milliseconds value) { return static_cast<double>(value.count()) / 1000.0; }
};

namespace detail {

/// Seconds from the environment variable `name` ("90", "1.5"), or nothing when unset.
/// @throws trainloop::ConfigurationError for another text.
inline std::optional<std::chrono::milliseconds> env_seconds(const char* name, const std::string& text) {
  char* end = nullptr;
  const double seconds = std::strtod(text.c_str(), &end);
  TRAINLOOP_CHECK(end != text.c_str() && *end == '\0' && std::isfinite(seconds) && seconds > 0 && seconds < 1e7, name,
                  " is \"", text, "\"; expected a positive number of seconds",
                  std::string(name) == "TRAINLOOP_STALL_LIMIT" ? " or \"off\"" : "");
  return std::chrono::milliseconds(static_cast<long long>(std::llround(seconds * 1000.0)));
}

}  // namespace detail

/// `options` with the environment's overrides: TRAINLOOP_STALL_LIMIT (seconds, or "off"),
/// TRAINLOOP_STALL_ACTION ("fail" or "report"), TRAINLOOP_STALL_CHECKPOINT_LIMIT (seconds),
/// TRAINLOOP_STRAGGLER ("off", or the least excess per step in milliseconds).
/// @throws trainloop::ConfigurationError naming a variable whose value is not one of those.
inline StallWatchOptions stall_options_from_environment(StallWatchOptions options) {
  using ::trainloop::detail::env_string;
  if (auto text = env_string("TRAINLOOP_STALL_LIMIT")) {
    if (*text == "off" || *text == "0") {
      options.enabled = false;
    } else {
      options.enabled = true;
      options.limit = *detail::env_seconds("TRAINLOOP_STALL_LIMIT", *text);
    }
  }
  if (auto text = env_string("TRAINLOOP_STALL_ACTION")) {
    TRAINLOOP_CHECK(*text == "fail" || *text == "report", "TRAINLOOP_STALL_ACTION is \"", *text,
                    "\"; expected \"fail\" or \"report\"");
    options.action = *text == "fail" ? StallAction::Fail : StallAction::Report;
  }
  if (auto text = env_string("TRAINLOOP_STALL_CHECKPOINT_LIMIT")) {
    options.checkpoint_limit = *detail::env_seconds("TRAINLOOP_STALL_CHECKPOINT_LIMIT", *text);
  }
  if (auto text = env_string("TRAINLOOP_STRAGGLER")) {  // "off", or the least excess in milliseconds
    options.straggler.enabled = *text != "off";
    if (options.straggler.enabled) {
      char* end = nullptr;
      const double ms = std::strtod(text->c_str(), &end);
      TRAINLOOP_CHECK(end != text->c_str() && *end == '\0' && ms > 0.0, "TRAINLOOP_STRAGGLER is \"", *text,
                      "\"; expected \"off\" or the least excess per step in milliseconds (e.g. 25)");
      options.straggler.least_excess = std::chrono::milliseconds(static_cast<long long>(std::llround(ms)));
    }
  }
  return options;
}

/// Whether two watchdogs' options are the same.
inline bool same_stall_options(const StallWatchOptions& a, const StallWatchOptions& b) {
  return a.enabled == b.enabled && a.limit == b.limit && a.step_factor == b.step_factor && a.grace_steps == b.grace_steps &&
         a.grace_factor == b.grace_factor && a.checkpoint_limit == b.checkpoint_limit && a.action == b.action;
}

/// The options in words, for a message.
inline std::string stall_options_words(const StallWatchOptions& options) {
  if (!options.enabled) return "off";
  return ::trainloop::detail::concat("limit ", options.limit.count(), " ms, ", options.step_factor, " x the slowest step, ",
                                     options.action == StallAction::Report ? "report" : "fail");
}

}  // namespace trainloop::distributed
