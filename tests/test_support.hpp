#pragma once
// Small helpers shared by the test programs.

#include <trainloop/error.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
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

/// The environment variable's value, or `fallback` when it is unset.
inline std::string env_or(const char* name, const std::string& fallback = "") {
  const char* value = std::getenv(name);
  return value ? value : fallback;
}

/// Writes `text` to `path` through a temporary file renamed into place, so a reader (another
/// process polling for the file) never sees half of it.
inline void write_file(const std::filesystem::path& path, const std::string& text) {
  auto temporary = path;
  temporary += ".tmp";
  { std::ofstream(temporary) << text; }
  std::filesystem::rename(temporary, path);
}
