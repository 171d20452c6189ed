#pragma once
/// @file
/// @brief Stopwatch: seconds on the steady clock (epoch and fit durations in the History).

#include <chrono>

namespace trainloop::detail {

/// Seconds since a start point.
class Stopwatch {
 public:
  Stopwatch() : start_(std::chrono::steady_clock::now()) {}
  double seconds() const { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count(); }

 private:
  std::chrono::steady_clock::time_point start_;
};

}  // namespace trainloop::detail
