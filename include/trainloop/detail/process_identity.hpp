#pragma once
/// @file
/// @brief Which process owns a file or directory, and whether it still lives: a pid with its
/// start time (pids are reused, the pair is not) and the machine and pid namespace the pid
/// belongs to (a TMPDIR or checkpoint directory shared by several machines or containers holds
/// owners whose pids mean nothing here). Used to remove what dead writers and launchers left.

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <system_error>
#include <unistd.h>

namespace trainloop::detail {

/// When process `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22), or 0 when
/// it does not exist.
inline std::uint64_t process_start_time(long pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto name_end = stat.rfind(')');  // the command name may hold spaces and ')'
  if (name_end == std::string::npos) return 0;
  std::istringstream fields(stat.substr(name_end + 2));
  std::string field;
  for (int index = 3; index <= 22 && fields >> field; ++index) {
    if (index == 22) return std::stoull(field);
  }
  return 0;
}

/// True while the process `pid` that started at `start_time` (process_start_time) is alive.
inline bool process_alive(long pid, std::uint64_t start_time) {
  return pid > 0 && start_time != 0 && process_start_time(pid) == start_time;
}

/// Which machine and pid namespace this process's pid belongs to: boot id, host name and pid
/// namespace, as one string without spaces.
inline std::string pid_domain() {
  std::string boot_id;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot_id;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::error_code ignored;
  const auto namespace_link = std::filesystem::read_symlink("/proc/self/ns/pid", ignored).string();
  std::string domain = boot_id + "/" + host + "/" + namespace_link;
  for (char& c : domain) {
    if (c == ' ' || c == '\n') c = '_';
  }
  return domain;
}

/// pid_domain() as 16 hex digits (FNV-1a), short and safe inside a file name.
inline std::string pid_domain_tag() {
  std::uint64_t hash = 14695981039346656037ull;
  for (const unsigned char c : pid_domain()) hash = (hash ^ c) * 1099511628211ull;
  static const char* digits = "0123456789abcdef";
  std::string tag(16, '0');
  for (int i = 15; i >= 0; --i, hash >>= 4) tag[static_cast<size_t>(i)] = digits[hash & 0xf];
  return tag;
}

/// "<pid>-<start time>-<domain tag>": this process, as a file name part that owner_tag_is_dead() judges.
inline std::string own_owner_tag() {
  return std::to_string(::getpid()) + "-" + std::to_string(process_start_time(::getpid())) + "-" + pid_domain_tag();
}

/// True when `tag` (an own_owner_tag() of some process) names a process of this machine and pid
/// namespace that has ended. Tags of other machines, or that do not parse, are not ours to judge.
inline bool owner_tag_is_dead(const std::string& tag) {
  const auto first = tag.find('-');
  const auto second = first == std::string::npos ? std::string::npos : tag.find('-', first + 1);
  if (second == std::string::npos) return false;
  if (tag.substr(second + 1) != pid_domain_tag()) return false;
  try {
    return !process_alive(std::stol(tag.substr(0, first)), std::stoull(tag.substr(first + 1, second - first - 1)));
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace trainloop::detail
