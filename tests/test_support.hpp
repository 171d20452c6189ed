#pragma once
// Small helpers shared by the test programs.

#include <trainloop/error.hpp>

#include <functional>
#include <string>

/// The message of the trainloop::Error that `action` throws, or a marker that none was thrown
/// (which no expected message contains, so the caller's check fails).
inline std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const trainloop::Error& error) {
    return error.what();
  }
  return "<no trainloop::Error was thrown>";
}
