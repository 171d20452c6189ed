#pragma once
// Small helpers shared by the test programs.

#include <trainloop/error.hpp>

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <filesystem>
#include <system_error>
#include <fstream>
#include <functional>
#include <string>

#include <unistd.h>

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

/// A fresh directory under the system temp dir (mkdtemp), removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix = "tl-test") {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
    const char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) {
      throw std::system_error(errno, std::generic_category(), "TempDir: cannot create " + pattern);
    }
    path = made;
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
};

/// What a shell command printed (stdout; append 2>&1 for stderr too) and its exit status (-1
/// when a signal ended it).
struct CommandRun {
  int exit_code = -1;
  std::string output;
};

/// Runs `command` through the shell and waits for it.
inline CommandRun run_command(const std::string& command) {
  CommandRun run;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) run.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

/// Processes started as the program `name` (none of a job's may outlive it), by their argv[0]:
/// the test workers are links to one binary (test_workers), so /proc/<pid>/exe names that binary
/// for every one of them, and the ranks a launcher starts run /proc/self/exe (their comm is "exe")
/// with the launching process's argv[0].
inline int processes_running(const std::string& name) {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    std::ifstream cmdline(entry.path() / "cmdline");
    std::string argv0;
    if (!std::getline(cmdline, argv0, '\0') || argv0.empty()) continue;
    if (std::filesystem::path(argv0).filename() == name) ++count;
  }
  return count;
}
