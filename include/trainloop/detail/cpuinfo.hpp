#pragma once
/// @file
/// @brief What /proc/cpuinfo says about this machine's CPU (model name, clock, instruction-set
/// flags), read in one place for precision/native_bf16.hpp and the benchmarks. Every core lists
/// the same flags, so the first processor's lines speak for the machine.

#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

namespace trainloop::detail {

/// The value of the first line of `cpuinfo` whose key is `key` ("model name", "flags", "cpu MHz"),
/// without the blanks around it ("model name\t: Intel(R) ..." gives "Intel(R) ..."); empty when absent.
inline std::string cpuinfo_value(const std::string& cpuinfo, std::string_view key) {
  constexpr const char* blanks = " \t";
  std::istringstream lines(cpuinfo);
  for (std::string line; std::getline(lines, line);) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string name = line.substr(0, colon);
    const auto name_end = name.find_last_not_of(blanks);
    if (name_end == std::string::npos || std::string_view(name).substr(0, name_end + 1) != key) continue;
    const auto first = line.find_first_not_of(blanks, colon + 1);
    if (first == std::string::npos) return {};
    return line.substr(first, line.find_last_not_of(blanks) + 1 - first);
  }
  return {};
}

/// Whether the flags line of `cpuinfo` lists `flag` as a whole word ("avx512_bf16", "fma").
inline bool cpuinfo_has_flag(const std::string& cpuinfo, std::string_view flag) {
  std::istringstream flags(cpuinfo_value(cpuinfo, "flags"));
  for (std::string word; flags >> word;) {
    if (word == flag) return true;
  }
  return false;
}

/// The text of /proc/cpuinfo (empty where there is none), read once per process.
inline const std::string& cpuinfo_text() {
  static const std::string text = [] {
    std::ifstream file("/proc/cpuinfo");
    std::ostringstream contents;
    contents << file.rdbuf();
    return contents.str();
  }();
  return text;
}

}  // namespace trainloop::detail
