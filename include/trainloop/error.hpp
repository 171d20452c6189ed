#pragma once
/// @file
/// @brief The one exception type trainloop throws, and the check macro that builds its message.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace trainloop {

/// Thrown for every user-facing failure: bad options, bad data, a failed rank.
/// The message names the offending value and what was expected instead.
class Error : public std::runtime_error {
 public:
  /// @brief An error with its complete, user-facing message.
  explicit Error(const std::string& message) : std::runtime_error(message) {}
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

/// Throws trainloop::Error with the streamed message parts when `condition` is false,
/// in the spirit of TORCH_CHECK: `TRAINLOOP_CHECK(batch_size > 0, "batch_size is ", batch_size, "; expected > 0")`.
#define TRAINLOOP_CHECK(condition, ...)                                        \
  do {                                                                         \
    if (!(condition)) {                                                        \
      throw ::trainloop::Error(::trainloop::detail::concat("trainloop: ", __VA_ARGS__)); \
    }                                                                          \
  } while (false)
