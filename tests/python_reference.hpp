#pragma once
// The reference for tests that compare with Python: the Python torch of the same libtorch the
// tests were built with (the venv scripts/install-deps.sh made, whose python3 CMake passes in as
// TRAINLOOP_TORCH_PYTHON), with torchvision. Cases that need it are skipped
// (TRAINLOOP_TEST_SKIPPED, ctest: Skipped) where no such python3 is found; a Python torch of
// another release is never taken as the reference.

#include "unit_test.hpp"

#include <torch/version.h>

#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

/// A python3 whose torch is this build's libtorch release (TORCH_VERSION) and which imports
/// torchvision, or "" when none is: $TRAINLOOP_PYTHON when set, else the venv's python3 the build
/// found libtorch in (TRAINLOOP_TORCH_PYTHON), else the first python3 on PATH.
inline const std::string& reference_python() {
  static const std::string found = [] {
    std::vector<std::string> candidates;
    if (const char* chosen = std::getenv("TRAINLOOP_PYTHON")) {
      candidates = {chosen};
    } else {
#ifdef TRAINLOOP_TORCH_PYTHON
      candidates.emplace_back(TRAINLOOP_TORCH_PYTHON);
#endif
      candidates.emplace_back("python3");
    }
    for (const auto& candidate : candidates) {
      const std::string probe = "'" + candidate +
                                "' -c 'import sys, torch, torchvision; sys.exit(torch.__version__.split(\"+\")[0] != \"" +
                                TORCH_VERSION + "\")' >/dev/null 2>&1";
      if (std::system(probe.c_str()) == 0) return candidate;
    }
    return std::string();
  }();
  return found;
}

/// Precondition of the cases that need Python (Boost.Test skips the case and ctest reports the
/// program Skipped).
inline boost::test_tools::assertion_result python_present(boost::unit_test::test_unit_id) {
  if (!reference_python().empty()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: no python3 imports torch " << TORCH_VERSION
            << " (this build's libtorch) and torchvision (set TRAINLOOP_PYTHON)" << std::endl;
  boost::test_tools::assertion_result result(false);
  result.message() << "no python3 with torch and torchvision";
  return result;
}

/// What a Python command printed (stdout and stderr) and its exit status.
struct PythonRun {
  int exit_code = -1;
  std::string output;
};

/// Runs `python3 SCRIPT COMMAND WORK ARGS...` where SCRIPT holds `script_text` (written into
/// `work` once, as `script_name`).
inline PythonRun run_python_script(const std::filesystem::path& work, const std::string& script_name,
                                   const char* script_text, const std::string& command,
                                   const std::vector<std::string>& args = {}) {
  const auto script = work / script_name;
  if (!std::filesystem::exists(script)) std::ofstream(script) << script_text;
  std::string line = "'" + reference_python() + "' '" + script.string() + "' " + command + " '" + work.string() + "'";
  for (const auto& arg : args) line += " '" + arg + "'";
  line += " 2>&1";
  PythonRun run;
  FILE* pipe = ::popen(line.c_str(), "r");
  BOOST_REQUIRE(pipe != nullptr);
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) run.output.append(buffer, n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}
