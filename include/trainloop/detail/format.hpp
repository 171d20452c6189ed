#pragma once
/// @file
/// @brief Number and duration formatting for progress output and CSV files.

#include <cmath>
#include <cstdio>
#include <string>

namespace trainloop::detail {

/// `value` with `digits` digits after the point ("nan" and "inf" as such).
inline std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof buffer, "%.*f", digits, value);
  return buffer;
}

/// Seconds as "1h02m03s", "2m03s" or "3s".
inline std::string duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto total = static_cast<long long>(std::llround(seconds));
  char buffer[64];
  if (total >= 3600) {
    std::snprintf(buffer, sizeof buffer, "%lldh%02lldm%02llds", total / 3600, total / 60 % 60, total % 60);
  } else if (total >= 60) {
    std::snprintf(buffer, sizeof buffer, "%lldm%02llds", total / 60, total % 60);
  } else {
    std::snprintf(buffer, sizeof buffer, "%llds", total);
  }
  return buffer;
}

}  // namespace trainloop::detail
