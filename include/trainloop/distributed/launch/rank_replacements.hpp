#pragma once
/// @file
/// @brief Elastic training, the launcher's side (distributed/launch/launcher.hpp): the processes it
/// starts in place of lost ranks, and the line of a machine whose ranks all start as replacements
/// because the job is training already (LaunchOptions::joins_running_fit). Joining the job is the
/// ranks' own business (distributed/elastic/replacement_join.hpp).

#include <trainloop/distributed/launch/launch_options.hpp>
#include <trainloop/distributed/launch/posix_process.hpp>

#include <algorithm>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace trainloop::distributed {

/// A process in place of each rank in `lost_ranks` that has replacements left
/// (LaunchOptions::max_replacements; the first process of a rank's place is not one), appended to
/// `ranks` and started by `spawn`; it joins the running job when the others admit it. A place whose
/// replacements are used up, or whose replacement cannot start, is named and left: the others go on
/// without it.
template <class Spawn>
void start_replacements(std::vector<RankProcess>& ranks, const LaunchOptions& options, const std::vector<int>& lost_ranks,
                        Spawn&& spawn) {
  for (int rank : lost_ranks) {
    const auto same_rank = [rank](const RankProcess& process) { return process.rank == rank; };
    const int started = static_cast<int>(std::count_if(ranks.begin(), ranks.end(), same_rank)) - 1;
    if (started >= options.max_replacements()) {
      if (started > 0) {
        std::cerr << "trainloop: rank " << rank << " was lost again and its " << started << " replacement"
                  << (started == 1 ? " is" : "s are") << " used up (max_replacements " << options.max_replacements()
                  << "); the others go on without it\n";
      }
      continue;
    }
    RankProcess process;
    process.rank = rank;
    process.local_rank = std::find_if(ranks.begin(), ranks.end(), same_rank)->local_rank;
    process.replacement = started + 1;
    ranks.push_back(process);
    try {
      spawn(ranks.back());
    } catch (const std::exception& error) {
      std::cerr << "trainloop: cannot start a replacement for rank " << rank << ": " << error.what()
                << "; the others go on without it\n";
      ranks.pop_back();
      continue;
    }
    std::cerr << "trainloop: started a replacement for rank " << rank << " (pid " << ranks.back().pid << ", "
              << process.replacement << " of at most " << options.max_replacements() << "); it joins at a step boundary\n";
  }
}

/// The line of a machine that stands in for a lost one (LaunchOptions::joins_running_fit): its
/// ranks start as replacements of the job at the options' master address and `master_port`.
inline void say_this_machine_stands_in(const LaunchOptions& options, int master_port) {
  const int first = options.node_rank() * options.nprocs();
  const bool one = options.nprocs() == 1;
  std::cerr << "trainloop: the job at " << options.master_addr() << ":" << master_port
            << " is training already (elastic): this machine stands in for a lost one; its rank" << (one ? " " : "s ")
            << first << (one ? std::string() : "-" + std::to_string(first + options.nprocs() - 1))
            << (one ? " starts as a replacement and joins" : " start as replacements and join") << " at a step boundary\n";
}

}  // namespace trainloop::distributed
