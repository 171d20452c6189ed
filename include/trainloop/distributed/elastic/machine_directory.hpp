#pragma once
/// @file
/// @brief Elastic training of sharded state on several machines: the hand-off (a per-rank
/// checkpoint in memory, sharded_hand_off.hpp) is a directory that every rank reads whole, and a
/// machine's memory (/dev/shm) is its own. So each machine has its own copy of the directory, held
/// by its lead (the lowest rank there that knows one, else the lowest rank there) and named after
/// that rank's launcher — whose clean-up removes what a killed rank leaves on that machine. The
/// ranks write their files into their machine's copy; then every file a machine lacks comes from
/// the lead of the first machine that has it, point to point (send_bytes, comm/point_to_point.hpp):
/// each machine receives only what it lacks, once. On one machine there is one directory and nothing
/// travels. Machines are told apart by pid_domain_tag() (boot id, host name, pid namespace).
///
/// Both functions are collectives over the group and never throw between its collectives: a
/// failure is kept in `failure` for the caller's agreement (every rank learns it from one
/// all-reduce, and the leads remove their copies).

#include <trainloop/detail/format.hpp>
#include <trainloop/detail/process_identity.hpp>
#include <trainloop/distributed/comm/point_to_point.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/text_collectives.hpp>
#include <trainloop/distributed/elastic/hand_off_file.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

namespace trainloop::distributed::elastic {

/// This rank's machine's copy of a hand-off directory (machine_directory()).
struct MachineDirectory {
  std::filesystem::path path;  ///< the copy on this machine (empty when its lead could not make one)
  bool lead = false;           ///< this rank holds it for its machine: it finishes and removes it
  bool made = false;           ///< made by machine_directory(): named "<final>.partial" until finish_machine_directory()
  int machines = 1;            ///< how many machines the group spans
};

namespace detail {

/// `failure`, unless one is kept already (the first failure names the cause).
inline void keep_failure(std::exception_ptr& failure, std::exception_ptr now) {
  if (!failure) failure = std::move(now);
}

/// The names of the regular files in `directory`, sorted.
inline std::vector<std::string> file_names(const std::filesystem::path& directory) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(directory)) {
    if (entry.is_regular_file()) names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace detail

/// What one rank said of itself before deciding about machine copies.
struct MachineAndKnown {
  std::string machine;  ///< its machine's tag (pid_domain_tag())
  std::string known;    ///< the directory it knows, empty when none
};

/// Every rank's machine and the directory it knows (`known` for this rank), in rank order: one
/// all-gather of "<tag>\n<path>" texts. A collective of every rank of `group`.
inline std::vector<MachineAndKnown> every_rank_machine_and_known(ProcessGroup& group, const std::filesystem::path& known) {
  const std::vector<std::string> said = all_texts(group, ::trainloop::detail::pid_domain_tag() + "\n" + known.string());
  std::vector<MachineAndKnown> ranks;
  ranks.reserve(said.size());
  for (const std::string& text : said) {
    const std::size_t newline = text.find('\n');
    ranks.push_back({text.substr(0, newline), newline == std::string::npos ? std::string() : text.substr(newline + 1)});
  }
  return ranks;
}

/// Whether this rank is the lowest rank of its machine among those that know `known` (false when
/// `known` is empty): who removes a directory every rank there knows once its remover may be gone.
/// A collective of every rank of `group`.
inline bool lowest_on_machine_knowing(ProcessGroup& group, const std::filesystem::path& known) {
  const std::vector<MachineAndKnown> ranks = every_rank_machine_and_known(group, known);
  const std::string& own_machine = ranks[static_cast<size_t>(group.rank())].machine;
  for (int rank = 0; rank < group.world_size(); ++rank) {
    const MachineAndKnown& said = ranks[static_cast<size_t>(rank)];
    if (said.machine == own_machine && !said.known.empty()) return rank == group.rank();
  }
  return false;
}

/// Every rank's copy of a directory on its machine (see the file comment): the one a rank of its
/// machine knows (`known`, empty when this rank knows none), else a new empty
/// "<in_memory_path(name)>.partial" made by its machine's lead (`bytes`: about what it will hold).
inline MachineDirectory machine_directory(ProcessGroup& group, const RankEnv& env, const std::filesystem::path& known,
                                          const std::string& name, std::uintmax_t bytes, std::exception_ptr& failure) {
  const std::vector<MachineAndKnown> ranks = every_rank_machine_and_known(group, known);
  // Every rank decides alike from what every rank said: machines in the order of their lowest rank.
  std::vector<std::string> tags;
  std::map<std::string, int> lead_of;  // machine tag -> its lead
  std::map<std::string, std::string> known_on;
  for (int rank = 0; rank < group.world_size(); ++rank) {
    const auto& [tag, path] = ranks[static_cast<size_t>(rank)];
    if (!lead_of.count(tag)) tags.push_back(tag), lead_of[tag] = rank;
    if (!path.empty() && !known_on.count(tag)) known_on[tag] = path, lead_of[tag] = rank;
  }
  const std::string& own_tag = ranks[static_cast<size_t>(group.rank())].machine;
  MachineDirectory mine;
  mine.machines = static_cast<int>(tags.size());
  mine.lead = lead_of[own_tag] == group.rank();
  mine.made = !known_on.count(own_tag);
  std::string made_path;  // a lead that makes its machine's copy says where
  if (mine.lead && mine.made) {
    try {
      const std::filesystem::path target = detail::in_memory_path(env, name, bytes);
      std::error_code ignored;
      std::filesystem::remove_all(target, ignored);
      std::filesystem::remove_all(target.string() + ".partial", ignored);
      std::filesystem::create_directories(target.string() + ".partial");
      made_path = target.string() + ".partial";
    } catch (...) {
      detail::keep_failure(failure, std::current_exception());
    }
  }
  // Every rank takes part in telling the copies made (whether any was is the same everywhere).
  const bool any_made = std::any_of(tags.begin(), tags.end(), [&](const std::string& tag) { return !known_on.count(tag); });
  if (any_made && mine.machines == 1) {
    mine.path = broadcast_text(group, made_path, lead_of[own_tag]);
  } else if (any_made) {
    mine.path = all_texts(group, made_path)[static_cast<size_t>(lead_of[own_tag])];
  }
  if (!mine.made) mine.path = known_on[own_tag];
  if (mine.path.empty()) {
    detail::keep_failure(failure, std::make_exception_ptr(CommunicationError(
                                      "trainloop: no copy of the elastic hand-off could be made on this machine "
                                      "(its lead's error names the cause)")));
  }
  return mine;
}

/// Completes every machine's copy (machine_directory()) with the files another machine's copy
/// has and it lacks, each sent once from the first machine that has it to the lead of each that
/// lacks it. Nothing on one machine.
inline void fill_from_other_machines(ProcessGroup& group, const MachineDirectory& mine, std::exception_ptr& failure) {
  if (mine.machines == 1) return;
  std::string listed;  // a lead: "lead", then the files of its copy, one a line (none: it lacks every file)
  if (mine.lead && !mine.path.empty()) {
    try {
      listed = "lead\n";
      for (const std::string& file : detail::file_names(mine.path)) listed += file + "\n";
    } catch (...) {
      detail::keep_failure(failure, std::current_exception());
    }
  }
  const std::vector<std::string> lists = all_texts(group, listed);
  // Every rank plans alike: for each file, the first lead listing it sends it to each lead that does not.
  std::map<std::string, int> source;
  std::vector<std::pair<int, std::set<std::string>>> leads;
  for (int rank = 0; rank < group.world_size(); ++rank) {
    const std::string& text = lists[static_cast<size_t>(rank)];
    if (text.rfind("lead\n", 0) != 0) continue;
    std::set<std::string> files;
    std::istringstream in(text.substr(5));
    for (std::string file; std::getline(in, file);) files.insert(file), source.emplace(file, rank);
    leads.emplace_back(rank, std::move(files));
  }
  for (const auto& [file, from] : source) {
    for (const auto& [to, has] : leads) {
      if (has.count(file)) continue;
      torch::Tensor data;
      if (group.rank() == from) {
        try {
          data = detail::file_bytes(mine.path / file);
        } catch (...) {
          detail::keep_failure(failure, std::current_exception());
          data = torch::empty({0}, torch::kUInt8);  // the receiver still gets its message; the agreement fails
        }
      }
      const torch::Tensor received = send_bytes(group, data, from, to);
      if (group.rank() != to) continue;
      try {
        detail::write_file_bytes(mine.path / file, received);
      } catch (...) {
        detail::keep_failure(failure, std::current_exception());
      }
    }
  }
}

/// A lead's copy made by machine_directory() takes its final name (without ".partial"); returns
/// that name on every rank of its machine.
inline std::filesystem::path finish_machine_directory(const MachineDirectory& mine, std::exception_ptr& failure) {
  if (!mine.made || mine.path.empty()) return mine.path;
  const std::string partial = mine.path.string();
  const std::filesystem::path target = partial.substr(0, partial.size() - std::string(".partial").size());
  if (mine.lead && !failure) {
    try {
      std::filesystem::rename(partial, target);
    } catch (...) {
      detail::keep_failure(failure, std::current_exception());
    }
  }
  return target;
}

/// After a failed agreement: a lead removes its machine's copy, whatever its name.
inline void remove_machine_directory(const MachineDirectory& mine) noexcept {
  if (!mine.lead || mine.path.empty()) return;
  std::error_code ignored;  // gone already: nothing to report
  std::filesystem::remove_all(mine.path, ignored);
  if (mine.made) {
    const std::string partial = mine.path.string();
    std::filesystem::remove_all(partial.substr(0, partial.size() - std::string(".partial").size()), ignored);
  }
}

/// The agreement after the collectives above: returns when no rank kept a failure; otherwise the
/// leads remove their copies and every rank throws, naming this rank's failure (or saying another
/// rank's error names it) after `what`.
/// @throws trainloop::CommunicationError on every rank when any kept a failure.
inline void agree_every_copy_is_whole(ProcessGroup& group, const MachineDirectory& mine, const std::exception_ptr& failure,
                                      const std::string& what) {
  torch::Tensor failed = torch::full({1}, failure ? 1.0 : 0.0, torch::kFloat32);
  group.all_reduce_max(failed);
  if (failed.item<float>() < 0.5f) return;
  remove_machine_directory(mine);
  std::string cause = "another rank could not write its part (its error names the cause)";
  if (failure) {
    try {
      std::rethrow_exception(failure);
    } catch (const std::exception& error) {
      cause = error.what();
    }
  }
  throw CommunicationError(::trainloop::detail::concat(what, ": ", cause));
}

/// The end of a hand-off made of machine copies, on every rank of `group`: every copy filled
/// (fill_from_other_machines), a made one given its final name (finish_machine_directory), and
/// the agreement (agree_every_copy_is_whole); returns this machine's copy.
/// @throws trainloop::CommunicationError on every rank when any kept a failure.
inline std::filesystem::path complete_every_copy(ProcessGroup& group, const MachineDirectory& mine, std::exception_ptr& failure,
                                                 const std::string& what) {
  fill_from_other_machines(group, mine, failure);
  const std::filesystem::path target = finish_machine_directory(mine, failure);
  agree_every_copy_is_whole(group, mine, failure, what);
  return target;
}

}  // namespace trainloop::distributed::elastic
