#pragma once
/// @file
/// @brief What the launcher starts and how (LaunchOptions); what it knows about each rank it
/// started is RankProcess (posix_process.hpp).

#include <trainloop/distributed/launch/posix_process.hpp>

#include <torch/arg.h>

#include <chrono>
#include <map>
#include <string>
#include <sys/types.h>
#include <vector>

namespace trainloop::distributed {

/// Extra environment for the children: name → value, overriding inherited values.
using EnvVars = std::map<std::string, std::string>;

/// What to start and how to watch it. Only `nprocs` is required.
struct LaunchOptions {
  /// @param nprocs number of ranks to start on this node
  explicit LaunchOptions(int nprocs) : nprocs_(nprocs) {}
  /// Number of ranks started on this node (local ranks 0..nprocs-1).
  TORCH_ARG(int, nprocs);
  /// Number of nodes; world size = nnodes * nprocs.
  TORCH_ARG(int, nnodes) = 1;
  /// This node's index; global rank = node_rank * nprocs + local rank.
  TORCH_ARG(int, node_rank) = 0;
  /// Host of rank 0's TCPStore, as the ranks should reach it.
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";
  /// Port of rank 0's TCPStore; 0 picks a free one (single node only).
  TORCH_ARG(int, master_port) = 0;
  /// On node 0, fail early with a clear message when master_port is already taken.
  TORCH_ARG(bool, check_port) = true;
  /// How long stopped ranks get between SIGTERM and SIGKILL.
  TORCH_ARG(std::chrono::milliseconds, grace_period) = std::chrono::seconds(3);
  /// How often the launcher looks at its children.
  TORCH_ARG(std::chrono::milliseconds, poll_interval) = std::chrono::milliseconds(10);
  /// Keep the run directory after the Launcher is destroyed (for debugging).
  TORCH_ARG(bool, keep_run_dir) = false;
  /// Send each rank's stdout and stderr to `<run_dir>/rank<N>.log` instead of the terminal.
  TORCH_ARG(bool, log_to_files) = false;
  /// Extra variables for every child (they override inherited ones, not the TRAINLOOP_* ones).
  TORCH_ARG(EnvVars, env) = {};
  /// Directory in which the run directory is created; empty means $TMPDIR (or /tmp).
  TORCH_ARG(std::string, run_dir_parent) = "";
  /// Where the complete error text of a failed rank is kept (the run directory is removed);
  /// empty means $TMPDIR (or /tmp). The error message names the file.
  TORCH_ARG(std::string, error_file_dir) = "";
  /// Count a rank that exits 0 without having called report_rank_completed() as failed: it
  /// ended (e.g. the program called exit(0)) while the others still needed it. DDP sets this.
  TORCH_ARG(bool, require_completion) = false;
  /// Elastic training (distributed/elastic/): a rank other than 0 that ends does not stop the
  /// others, which regroup and go on; the launch succeeds when every other rank completes.
  TORCH_ARG(bool, elastic) = false;
  /// Elastic training: how many replacements the launcher starts for each rank's place (rank 0's
  /// excepted: it holds the store) when its process ends before its work is done; each joins the
  /// running job (distributed/elastic/replacement_join.hpp) with TRAINLOOP_REPLACEMENT set.
  TORCH_ARG(int, max_replacements) = 0;
  /// Elastic training on several machines: the job's fit is training already (this machine stands
  /// in for one that was lost): every rank starts as a replacement that joins it at a step
  /// boundary (TRAINLOOP_REPLACEMENT set), instead of meeting the others at the fit's start. Set by
  /// fit() when it finds the job training (distributed/elastic/replacement_join.hpp:
  /// running_fit_admits()). Those first processes do not count against max_replacements.
  TORCH_ARG(bool, joins_running_fit) = false;
  /// Program to run; the default re-executes this very binary.
  TORCH_ARG(std::string, executable) = "/proc/self/exe";
  /// Arguments including argv[0]; empty means this process's own, from /proc/self/cmdline.
  TORCH_ARG(std::vector<std::string>, argv) = {};
};

}  // namespace trainloop::distributed
