#pragma once
/// @file
/// @brief Reading environment variables: unset and empty are the same, numbers are checked.
/// Shared by the CPU thread defaults (OMP_NUM_THREADS) and the launchers' rank variables.

#include <trainloop/error.hpp>

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace trainloop::detail {

/// The variable's value, or nullopt when unset. Empty strings count as unset, as shells
/// often export `VAR=` to clear a variable.
inline std::optional<std::string> env_string(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

/// Parses a whole string as a decimal integer in [min, max]; throws naming `what` otherwise.
inline long parse_integer(std::string_view text, const std::string& what, long min, long max) {
  long value = 0;
  const char* end = text.data() + text.size();
  auto [stop, error] = std::from_chars(text.data(), end, value);
  TRAINLOOP_CHECK(error == std::errc() && stop == end && !text.empty(), what, "='", text,
                  "' is not an integer; expected a decimal number");
  TRAINLOOP_CHECK(value >= min && value <= max, what, "=", value, " is out of range; expected ",
                  min, " <= ", what, " <= ", max);
  return value;
}

}  // namespace trainloop::detail
