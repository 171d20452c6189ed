#pragma once
/// @file
/// @brief trainloop's exception types, and the check macro that builds their messages.
///
/// | type                 | thrown when                                                           |
/// |----------------------|-----------------------------------------------------------------------|
/// | Error                | base of everything trainloop throws itself                            |
/// | ConfigurationError   | an option, argument, input file or data value is not what is expected |
/// | CommunicationError   | the rendezvous or a collective failed (a peer died, a timeout)        |
/// | CheckpointError      | a checkpoint cannot be read, does not fit, or cannot be written       |
/// | RankFailedError      | a rank this process launched failed; names the rank and how it ended  |
/// | StallError           | a rank made no progress for the stall limit while others waited on it |
/// | DesyncError          | ranks called different collectives; names both calls and their steps  |
///
/// Errors that are not trainloop's keep their type: a libtorch error (`c10::Error`, e.g.
/// `c10::OutOfMemoryError`) thrown by the model or the criterion reaches the caller as that same
/// object, with trainloop's context (epoch, batch, shapes) added to its message, so
/// `catch (const c10::OutOfMemoryError&)` still works; see detail/error_context.hpp.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainloop {

/// @brief Base of every exception trainloop throws itself. The message names the offending
/// value and what was expected instead.
class Error : public std::runtime_error {
 public:
  /// @brief An error with its complete, user-facing message.
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

/// @brief A bad option, argument, file or data value: fixing the input fixes it.
class ConfigurationError : public Error {
 public:
  using Error::Error;
};

/// @brief A checkpoint that cannot be used or written: missing, truncated or corrupt, of another
/// model, of a newer format, or a write that failed (disk full, read-only directory). The message
/// names the file and, for a failed write, the system's reason.
class CheckpointError : public ConfigurationError {
 public:
  using ConfigurationError::ConfigurationError;
};

/// @brief The rendezvous or a collective failed: an unreachable master, a port in use, a peer
/// that died, a timeout. Usually a consequence of a failure elsewhere in the job.
class CommunicationError : public Error {
 public:
  using Error::Error;
};

/// @brief A rank made no progress for the stall limit while the others waited for it in a
/// collective (distributed/watch/stall_watchdog.hpp). The stalled rank's report names its step,
/// phase and stack; the waiting ranks end with one that names the stalled rank.
class StallError : public Error {
 public:
  using Error::Error;
};

/// @brief Ranks called different collectives as their n-th (another kind, dtype, size, root or
/// step): a rank skipped one, or called one the others did not. Names both calls.
class DesyncError : public Error {
 public:
  using Error::Error;
};

/// @brief A rank started by this process failed (DistributedDataParallel in a plain program).
class RankFailedError : public Error {
 public:
  /// @brief How the rank ended, as the launcher saw it.
  struct Details {
    int rank = -1;              ///< global rank of the failed process
    int exit_code = -1;         ///< exit status when it exited, else -1
    int signal = 0;             ///< terminating signal when killed, else 0
    std::string rank_error;     ///< the rank's own error message (first line first), if it left one
    std::string error_type;     ///< the C++ type of the rank's exception, if it left one
    std::string full_error_file;  ///< a file holding the rank's complete error text, or ""
  };
  /// @brief An error with its message and the failed rank's details.
  RankFailedError(const std::string& message, Details details) : Error(message), details_(std::move(details)) {}
  /// @brief How the rank ended.
  const Details& details() const { return details_; }

 private:
  Details details_;
};

namespace detail {
/// Streams every argument into one string; used to build error messages.
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
}  // namespace detail

}  // namespace trainloop

/// Throws trainloop::ConfigurationError with the streamed message parts when `condition` is
/// false, in the spirit of TORCH_CHECK:
/// `TRAINLOOP_CHECK(batch_size > 0, "batch_size is ", batch_size, "; expected > 0")`.
#define TRAINLOOP_CHECK(condition, ...)                                                                \
  do {                                                                                                 \
    if (!(condition)) {                                                                                \
      throw ::trainloop::ConfigurationError(::trainloop::detail::concat("trainloop: ", __VA_ARGS__)); \
    }                                                                                                  \
  } while (false)
