#pragma once
// Where a test program finds, at run time, the programs it starts (the workers, launcher_child)
// and trainloop's source tree (Python scripts the tests run).
//
// Not compile definitions, as they once were: an absolute path in a -D is part of ccache's key,
// so a checkout in another folder (CI's clean clone) missed the cache for every program that
// carried one (~600 s of CI's CPU). Every test program and worker is built into build/tests/
// (tests/CMakeLists.txt), which also holds trainloop_source_dir.txt, written at configure time.

#include <trainloop/error.hpp>

#include <filesystem>
#include <fstream>
#include <string>

/// The folder of the running program (through /proc/self/exe: a multicall worker started by one
/// of its link names resolves to the real program, in the same folder).
inline const std::filesystem::path& this_program_dir() {
  static const std::filesystem::path dir = std::filesystem::read_symlink("/proc/self/exe").parent_path();
  return dir;
}

/// The path of the test program or worker `name` (ddp_worker, stall_worker, launcher_child, ...),
/// built beside this one.
inline std::string test_program(const std::string& name) { return (this_program_dir() / name).string(); }

/// trainloop's source tree, as trainloop_source_dir.txt beside this program names it.
inline const std::filesystem::path& trainloop_source_dir() {
  static const std::filesystem::path dir = [] {
    const auto file = this_program_dir() / "trainloop_source_dir.txt";
    std::ifstream in(file);
    std::string line;
    if (!std::getline(in, line) || !std::filesystem::is_directory(line)) {
      throw trainloop::Error(file.string() + " names \"" + line +
                             "\"; expected trainloop's source folder (written when CMake configures the build)");
    }
    return std::filesystem::path(line);
  }();
  return dir;
}
