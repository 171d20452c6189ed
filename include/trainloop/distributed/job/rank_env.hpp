#pragma once
/// @file
/// @brief Is this process already one rank of a distributed job? Reads the environment left by
/// our own launcher, torchrun, Slurm's srun or Open MPI's mpirun, in that order.
///
/// Variables read, by source (the first source whose trigger variable is set wins):
///
/// | source    | trigger                 | rank / world                          | local rank / local world                               | node                   | master                                            |
/// |-----------|-------------------------|---------------------------------------|--------------------------------------------------------|------------------------|---------------------------------------------------|
/// | Trainloop | TRAINLOOP_RANK          | TRAINLOOP_RANK, TRAINLOOP_WORLD_SIZE  | TRAINLOOP_LOCAL_RANK, TRAINLOOP_LOCAL_WORLD_SIZE       | TRAINLOOP_NODE_RANK    | TRAINLOOP_MASTER_ADDR, TRAINLOOP_MASTER_PORT      |
/// | Torchrun  | RANK and WORLD_SIZE     | RANK, WORLD_SIZE                      | LOCAL_RANK, LOCAL_WORLD_SIZE (default: RANK, WORLD_SIZE)| GROUP_RANK             | MASTER_ADDR, MASTER_PORT (required)               |
/// | Slurm     | SLURM_PROCID, SLURM_NTASKS and SLURM_STEP_ID | SLURM_PROCID, SLURM_NTASKS      | SLURM_LOCALID, SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE | SLURM_NODEID | MASTER_ADDR or first host of SLURM_STEP_NODELIST / SLURM_JOB_NODELIST / SLURM_NODELIST; MASTER_PORT or 15000 + SLURM_JOB_ID % 10000 |
/// | OpenMPI   | OMPI_COMM_WORLD_RANK    | OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE | OMPI_COMM_WORLD_LOCAL_RANK, OMPI_COMM_WORLD_LOCAL_SIZE | rank / local size | MASTER_ADDR, MASTER_PORT; on one machine (local size = world size) 127.0.0.1 and 20000 + hash(OMPI_MCA_ess_base_jobid or PMIX_NAMESPACE) % 10000 |
///
/// The Trainloop source also carries TRAINLOOP_RUN_DIR (the launcher's run directory, where a
/// failing rank leaves its error text) and TRAINLOOP_LAUNCHER_PID (the pid the rank expects as
/// its parent; see die_with_parent() in spawned_rank.hpp). Torchrun's
/// TORCHELASTIC_USE_AGENT_STORE=True means the elastic agent already hosts the TCPStore, so
/// every rank, rank 0 included, must connect to it as a client. Slurm is recognised only inside
/// a job step (SLURM_STEP_ID, set by srun): a bare salloc or sbatch shell also exports
/// SLURM_PROCID=0 and SLURM_NTASKS=N, and taking that for rank 0 of N would wait forever for
/// ranks nobody started.
///
/// Every value is checked: a non-numeric number, a rank outside [0, world), a port outside
/// [1, 65535] throws trainloop::Error naming the variable and its value.

#include <trainloop/detail/environment.hpp>
#include <trainloop/detail/stable_hash.hpp>
#include <trainloop/error.hpp>

#include <charconv>
#include <cstdlib>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace trainloop::distributed {

/// Which launcher (if any) made this process a rank.
enum class RankEnvSource { None, Trainloop, Torchrun, Slurm, OpenMPI };

/// Human-readable name of a source, for messages and logs.
inline std::string_view to_string(RankEnvSource source) {
  switch (source) {
    case RankEnvSource::None: return "none";
    case RankEnvSource::Trainloop: return "trainloop";
    case RankEnvSource::Torchrun: return "torchrun";
    case RankEnvSource::Slurm: return "slurm";
    case RankEnvSource::OpenMPI: return "openmpi";
  }
  return "unknown";
}

/// Names of the variables our launcher gives each rank it spawns.
namespace env_names {
inline constexpr const char* rank = "TRAINLOOP_RANK";                          ///< global rank
inline constexpr const char* world_size = "TRAINLOOP_WORLD_SIZE";              ///< number of ranks
inline constexpr const char* local_rank = "TRAINLOOP_LOCAL_RANK";              ///< rank on this node
inline constexpr const char* local_world_size = "TRAINLOOP_LOCAL_WORLD_SIZE";  ///< ranks on this node
inline constexpr const char* node_rank = "TRAINLOOP_NODE_RANK";                ///< index of this node
inline constexpr const char* master_addr = "TRAINLOOP_MASTER_ADDR";            ///< host of the rendezvous store
inline constexpr const char* master_port = "TRAINLOOP_MASTER_PORT";            ///< port of the rendezvous store
inline constexpr const char* run_dir = "TRAINLOOP_RUN_DIR";                    ///< directory shared by launcher and ranks
inline constexpr const char* launcher_pid = "TRAINLOOP_LAUNCHER_PID";          ///< pid of the launching process
// The spawn relay's (spawn/spawn_session.hpp): which DDP fit() call a spawned rank trains.
inline constexpr const char* fit_index = "TRAINLOOP_FIT_INDEX";      ///< the DDP fit() call a spawned rank trains
inline constexpr const char* session_dir = "TRAINLOOP_SESSION_DIR";  ///< the launching process's session directory
inline constexpr const char* restart_count = "TRAINLOOP_RESTART_COUNT";  ///< relaunches so far (0 on the first)
/// Elastic training: set in a process the launcher started in place of a lost rank (its number
/// among that rank's replacements, from 1); it joins the running job when the survivors admit it.
inline constexpr const char* replacement = "TRAINLOOP_REPLACEMENT";
}  // namespace env_names

/// Where this process sits in a distributed job, and how to reach rank 0's store.
struct RankEnv {
  int rank = 0;              ///< global rank, in [0, world_size)
  int world_size = 1;        ///< number of ranks in the job
  int local_rank = 0;        ///< rank among the processes on this node, in [0, local_world_size)
  int local_world_size = 1;  ///< number of ranks on this node
  int node_rank = 0;         ///< index of this node
  std::string master_addr = "127.0.0.1";  ///< host of rank 0's TCPStore
  int master_port = 0;                    ///< port of rank 0's TCPStore
  /// True under torchrun's agent store: every rank (rank 0 too) is a TCPStore client.
  bool use_agent_store = false;
  /// torchrun's TORCHELASTIC_RESTART_COUNT: how often the agent restarted the workers. Its store
  /// outlives the workers, so each attempt keeps its keys apart (a restarted rank 0 would
  /// otherwise read the dead rank 1's address of the previous attempt and fail to connect).
  int restart_count = 0;
  RankEnvSource source = RankEnvSource::None;  ///< who set the variables
  std::string run_dir;    ///< Trainloop source only: the launcher's run directory
  long launcher_pid = 0;  ///< Trainloop source only: the pid of the launching process
};

namespace detail {

using ::trainloop::detail::env_string;
using ::trainloop::detail::parse_integer;

/// The variable as an integer in [min, max], or nullopt when unset.
inline std::optional<int> env_int(const char* name, int min = 0, int max = 1 << 30) {
  auto text = env_string(name);
  if (!text) return std::nullopt;
  return static_cast<int>(parse_integer(*text, name, min, max));
}

/// Like env_int, but a missing variable is an error that says which source needed it.
inline int required_env_int(const char* name, std::string_view source, int min = 0,
                            int max = 1 << 30) {
  auto value = env_int(name, min, max);
  TRAINLOOP_CHECK(value.has_value(), name, " is not set but the environment looks like a ",
                  source, " rank; expected it to be set");
  return *value;
}

inline std::string required_env_string(const char* name, std::string_view source,
                                       std::string_view hint = "") {
  auto value = env_string(name);
  TRAINLOOP_CHECK(value.has_value(), name, " is not set but the environment looks like a ",
                  source, " rank; expected it to be set", hint);
  return *value;
}

/// Checks the invariants every source must satisfy; names the variables in the message.
inline void check_rank_env(const RankEnv& env, const char* rank_var, const char* world_var,
                           const char* local_rank_var, const char* local_world_var) {
  TRAINLOOP_CHECK(env.world_size >= 1, world_var, "=", env.world_size, "; expected >= 1");
  TRAINLOOP_CHECK(env.rank < env.world_size, rank_var, "=", env.rank, " is not below ",
                  world_var, "=", env.world_size, "; expected 0 <= rank < world size");
  TRAINLOOP_CHECK(env.local_world_size >= 1 && env.local_world_size <= env.world_size,
                  local_world_var, "=", env.local_world_size, "; expected 1 <= it <= ",
                  world_var, "=", env.world_size);
  TRAINLOOP_CHECK(env.local_rank < env.local_world_size, local_rank_var, "=", env.local_rank,
                  " is not below ", local_world_var, "=", env.local_world_size,
                  "; expected 0 <= local rank < local world size");
}

/// Expands Slurm's compressed tasks-per-node list ("2(x3),1" → 2,2,2,1).
inline std::vector<int> expand_slurm_tasks_per_node(std::string_view text, const char* var) {
  std::vector<int> counts;
  while (!text.empty()) {
    auto comma = text.find(',');
    std::string_view item = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    long repeat = 1;
    if (auto paren = item.find("(x"); paren != std::string_view::npos) {
      TRAINLOOP_CHECK(item.back() == ')', var, "='", item, "' is malformed; expected N or N(xM)");
      repeat = parse_integer(item.substr(paren + 2, item.size() - paren - 3), var, 1, 1 << 20);
      item = item.substr(0, paren);
    }
    int count = static_cast<int>(parse_integer(item, var, 1, 1 << 20));
    counts.insert(counts.end(), static_cast<std::size_t>(repeat), count);
  }
  return counts;
}

}  // namespace detail

/// First host of a Slurm node list: "node7" → "node7", "a,b" → "a", "gpu[03-05,9]" → "gpu03",
/// "rack[1-2]-n[4,6]" → "rack1-n4". Every bracket group is replaced by its first element
/// as written, so zero padding is kept.
inline std::string slurm_first_host(std::string_view nodelist) {
  std::string host;
  int depth = 0;
  bool in_group_first_element = false;
  for (char c : nodelist) {
    if (depth == 0 && c == ',') break;  // end of the first host (or host range)
    if (c == '[') {
      TRAINLOOP_CHECK(depth == 0, "Slurm node list '", nodelist, "' has nested '['; expected host[1-3,5]");
      depth = 1;
      in_group_first_element = true;
    } else if (c == ']') {
      TRAINLOOP_CHECK(depth == 1, "Slurm node list '", nodelist, "' has an unmatched ']'");
      depth = 0;
    } else if (depth == 1) {
      if (c == ',' || c == '-') in_group_first_element = false;
      else if (in_group_first_element) host += c;
    } else {
      host += c;
    }
  }
  TRAINLOOP_CHECK(depth == 0 && !host.empty(), "Slurm node list '", nodelist,
                  "' is malformed; expected host, host1,host2 or prefix[1-3,5]");
  return host;
}

namespace detail {

inline RankEnv rank_env_from_trainloop() {
  using namespace env_names;
  constexpr std::string_view source = "trainloop launcher";
  RankEnv env;
  env.source = RankEnvSource::Trainloop;
  env.rank = required_env_int(env_names::rank, source);
  env.world_size = required_env_int(env_names::world_size, source, 1);
  env.local_rank = required_env_int(env_names::local_rank, source);
  env.local_world_size = required_env_int(env_names::local_world_size, source, 1);
  env.node_rank = required_env_int(env_names::node_rank, source);
  env.master_addr = required_env_string(env_names::master_addr, source);
  env.master_port = required_env_int(env_names::master_port, source, 1, 65535);
  env.run_dir = required_env_string(env_names::run_dir, source);
  env.launcher_pid = required_env_int(env_names::launcher_pid, source, 1);
  check_rank_env(env, env_names::rank, env_names::world_size, env_names::local_rank,
                 env_names::local_world_size);
  return env;
}

inline RankEnv rank_env_from_torchrun() {
  constexpr std::string_view source = "torchrun (or env://)";
  RankEnv env;
  env.source = RankEnvSource::Torchrun;
  env.rank = required_env_int("RANK", source);
  env.world_size = required_env_int("WORLD_SIZE", source, 1);
  // Hand-set env:// jobs often omit the local variables; they are then single-node.
  env.local_rank = env_int("LOCAL_RANK").value_or(env.rank);
  env.local_world_size = env_int("LOCAL_WORLD_SIZE", 1).value_or(env.world_size);
  env.node_rank = env_int("GROUP_RANK").value_or(env.rank / env.local_world_size);
  env.master_addr = required_env_string("MASTER_ADDR", source);
  env.master_port = required_env_int("MASTER_PORT", source, 1, 65535);
  auto agent_store = env_string("TORCHELASTIC_USE_AGENT_STORE");
  env.use_agent_store = agent_store && (*agent_store == "True" || *agent_store == "true" ||
                                        *agent_store == "1");
  env.restart_count = env_int("TORCHELASTIC_RESTART_COUNT").value_or(0);
  check_rank_env(env, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE");
  return env;
}

inline RankEnv rank_env_from_slurm() {
  constexpr std::string_view source = "Slurm (srun)";
  RankEnv env;
  env.source = RankEnvSource::Slurm;
  env.rank = required_env_int("SLURM_PROCID", source);
  env.world_size = required_env_int("SLURM_NTASKS", source, 1);
  env.local_rank = required_env_int("SLURM_LOCALID", source);
  env.node_rank = required_env_int("SLURM_NODEID", source);
  const char* local_world_var = "SLURM_NTASKS_PER_NODE";
  if (auto per_node = env_int(local_world_var, 1)) {
    env.local_world_size = *per_node;
  } else {
    // Non-uniform layouts only come as a compressed per-node list; the step's list is the
    // one that describes this srun, the job's list the whole allocation.
    local_world_var = "SLURM_STEP_TASKS_PER_NODE";
    auto list = env_string(local_world_var);
    if (!list) list = env_string(local_world_var = "SLURM_TASKS_PER_NODE");
    TRAINLOOP_CHECK(list.has_value(), "none of SLURM_NTASKS_PER_NODE, SLURM_STEP_TASKS_PER_NODE, "
                    "SLURM_TASKS_PER_NODE is set; expected srun to set one of them");
    auto counts = expand_slurm_tasks_per_node(*list, local_world_var);
    TRAINLOOP_CHECK(env.node_rank < static_cast<int>(counts.size()), "SLURM_NODEID=",
                    env.node_rank, " but ", local_world_var, "='", *list, "' lists only ",
                    counts.size(), " nodes");
    env.local_world_size = counts[static_cast<std::size_t>(env.node_rank)];
  }
  if (auto addr = env_string("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    auto nodelist = env_string("SLURM_STEP_NODELIST");
    if (!nodelist) nodelist = env_string("SLURM_JOB_NODELIST");
    if (!nodelist) nodelist = env_string("SLURM_NODELIST");
    TRAINLOOP_CHECK(nodelist.has_value(), "neither MASTER_ADDR nor SLURM_JOB_NODELIST / "
                    "SLURM_NODELIST is set; expected one of them to name rank 0's host");
    env.master_addr = slurm_first_host(*nodelist);
  }
  if (auto port = env_int("MASTER_PORT", 1, 65535)) {
    env.master_port = *port;
  } else if (auto job = env_string("SLURM_JOB_ID")) {
    // Same rule as PyTorch Lightning, so every task of a job derives the same port and two
    // jobs sharing a node rarely collide.
    env.master_port = 15000 + static_cast<int>(
        parse_integer(*job, "SLURM_JOB_ID", 0, 1L << 62) % 10000);
  } else {
    env.master_port = 29500;
  }
  check_rank_env(env, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", local_world_var);
  return env;
}

/// The port every rank of one mpirun job derives alike from the job's identity: Open MPI 4 names
/// the job in OMPI_MCA_ess_base_jobid, Open MPI 5 (PRRTE) in PMIX_NAMESPACE. 20000-29999 lies
/// below Linux's ephemeral range (32768-60999), so an outgoing connection rarely holds it, and two
/// jobs on one machine rarely collide (a collision is a clear "address in use" from the store).
inline std::optional<int> openmpi_job_port() {
  auto job = env_string("OMPI_MCA_ess_base_jobid");
  if (!job) job = env_string("PMIX_NAMESPACE");
  if (!job) return std::nullopt;
  return 20000 + static_cast<int>(trainloop::detail::stable_hash(*job) % 10000);
}

inline RankEnv rank_env_from_openmpi() {
  constexpr std::string_view source = "Open MPI (mpirun)";
  constexpr std::string_view hint =
      "; across machines Open MPI does not say where rank 0's store is: export MASTER_ADDR and MASTER_PORT "
      "(e.g. mpirun -x MASTER_ADDR=host0 -x MASTER_PORT=29500 ...)";
  RankEnv env;
  env.source = RankEnvSource::OpenMPI;
  env.rank = required_env_int("OMPI_COMM_WORLD_RANK", source);
  env.world_size = required_env_int("OMPI_COMM_WORLD_SIZE", source, 1);
  env.local_rank = required_env_int("OMPI_COMM_WORLD_LOCAL_RANK", source);
  env.local_world_size = required_env_int("OMPI_COMM_WORLD_LOCAL_SIZE", source, 1);
  // mpirun's default by-slot mapping fills nodes in rank order.
  env.node_rank = env.rank / env.local_world_size;
  // Every rank on this machine: rank 0's store is on the loopback, at a port derived from the job.
  const bool one_machine = env.local_world_size == env.world_size;
  const auto job_port = one_machine ? openmpi_job_port() : std::nullopt;
  if (auto addr = env_string("MASTER_ADDR")) {
    env.master_addr = *addr;
  } else if (job_port) {
    env.master_addr = "127.0.0.1";
  } else {
    env.master_addr = required_env_string("MASTER_ADDR", source, hint);
  }
  if (auto port = env_string("MASTER_PORT")) {
    env.master_port = static_cast<int>(parse_integer(*port, "MASTER_PORT", 1, 65535));
  } else {
    TRAINLOOP_CHECK(job_port.has_value(), "MASTER_PORT is not set but the environment looks like a ",
                    source, " rank; expected it to be set", hint);
    env.master_port = *job_port;
  }
  check_rank_env(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE");
  return env;
}

}  // namespace detail

/// Reads the rank environment, trying our launcher's variables, then torchrun's, Slurm's and
/// Open MPI's (see the table at the top of this file).
/// @return nullopt when no source's trigger variable is set: this process is not a rank yet
///         (the caller may spawn ranks itself).
/// @throws trainloop::Error when a source is recognised but one of its values is missing or
///         malformed; the message names the variable and its value.
inline std::optional<RankEnv> detect_rank_env() {
  using detail::env_string;
  if (env_string(env_names::rank)) return detail::rank_env_from_trainloop();
  if (env_string("RANK") && env_string("WORLD_SIZE")) return detail::rank_env_from_torchrun();
  if (env_string("SLURM_PROCID") && env_string("SLURM_NTASKS") && env_string("SLURM_STEP_ID")) {
    return detail::rank_env_from_slurm();
  }
  if (env_string("OMPI_COMM_WORLD_RANK")) return detail::rank_env_from_openmpi();
  return std::nullopt;
}

}  // namespace trainloop::distributed
