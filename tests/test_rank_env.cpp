#define BOOST_TEST_MODULE test_rank_env
#include "unit_test.hpp"

#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/launch/free_port.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <arpa/inet.h>
#include <cstdlib>
#include <map>
#include <netinet/in.h>
#include <optional>
#include <string>
#include <sys/socket.h>
#include <unistd.h>

namespace distributed = trainloop::distributed;
using distributed::RankEnvSource;

namespace {

/// Every variable any source reads; a fixture clears them all so the machine's own environment
/// (a CI job under Slurm, say) cannot leak into a test, and puts them back afterwards.
const char* const kRankVariables[] = {
    "TRAINLOOP_RANK", "TRAINLOOP_WORLD_SIZE", "TRAINLOOP_LOCAL_RANK",
    "TRAINLOOP_LOCAL_WORLD_SIZE", "TRAINLOOP_NODE_RANK", "TRAINLOOP_MASTER_ADDR",
    "TRAINLOOP_MASTER_PORT", "TRAINLOOP_RUN_DIR", "TRAINLOOP_LAUNCHER_PID", "RANK", "WORLD_SIZE",
    "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
    "SLURM_NODEID", "SLURM_STEP_ID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
    "SLURM_JOB_ID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE"};

struct CleanRankEnvironment {
  std::map<std::string, std::optional<std::string>> saved;
  CleanRankEnvironment() {
    for (const char* name : kRankVariables) {
      const char* value = std::getenv(name);
      saved[name] = value ? std::optional<std::string>(value) : std::nullopt;
      ::unsetenv(name);
    }
  }
  ~CleanRankEnvironment() {
    for (const auto& [name, value] : saved) {
      if (value) ::setenv(name.c_str(), value->c_str(), 1);
      else ::unsetenv(name.c_str());
    }
  }
  void set(const std::map<std::string, std::string>& variables) {
    for (const auto& [name, value] : variables) ::setenv(name.c_str(), value.c_str(), 1);
  }
};

/// The error message detect_rank_env throws, or "" when it does not throw.
std::string detect_error() {
  try {
    distributed::detect_rank_env();
  } catch (const trainloop::Error& error) {
    return error.what();
  }
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

const std::map<std::string, std::string> kTrainloopVars = {
    {"TRAINLOOP_RANK", "5"},          {"TRAINLOOP_WORLD_SIZE", "8"},
    {"TRAINLOOP_LOCAL_RANK", "1"},    {"TRAINLOOP_LOCAL_WORLD_SIZE", "4"},
    {"TRAINLOOP_NODE_RANK", "1"},     {"TRAINLOOP_MASTER_ADDR", "10.0.0.7"},
    {"TRAINLOOP_MASTER_PORT", "29511"}, {"TRAINLOOP_RUN_DIR", "/tmp/some-run"},
    {"TRAINLOOP_LAUNCHER_PID", "4242"}};

const std::map<std::string, std::string> kTorchrunVars = {
    {"RANK", "3"},        {"WORLD_SIZE", "4"},          {"LOCAL_RANK", "1"},
    {"LOCAL_WORLD_SIZE", "2"}, {"GROUP_RANK", "1"},     {"MASTER_ADDR", "node0"},
    {"MASTER_PORT", "29400"}};

const std::map<std::string, std::string> kSlurmVars = {
    {"SLURM_PROCID", "5"},  {"SLURM_NTASKS", "8"},          {"SLURM_LOCALID", "1"},
    {"SLURM_NODEID", "2"},  {"SLURM_STEP_ID", "0"},         {"SLURM_NTASKS_PER_NODE", "2"},
    {"SLURM_JOB_NODELIST", "gpu[03-05,9]"}, {"SLURM_JOB_ID", "123456"}};

}  // namespace

BOOST_FIXTURE_TEST_SUITE(rank_env, CleanRankEnvironment)

BOOST_AUTO_TEST_CASE(no_variables_means_not_a_rank) {
  BOOST_TEST(!distributed::detect_rank_env().has_value());
}

BOOST_AUTO_TEST_CASE(trainloop_variables_are_read) {
  set(kTrainloopVars);
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST((env->source == RankEnvSource::Trainloop));
  BOOST_TEST(env->rank == 5);
  BOOST_TEST(env->world_size == 8);
  BOOST_TEST(env->local_rank == 1);
  BOOST_TEST(env->local_world_size == 4);
  BOOST_TEST(env->node_rank == 1);
  BOOST_TEST(env->master_addr == "10.0.0.7");
  BOOST_TEST(env->master_port == 29511);
  BOOST_TEST(env->run_dir == "/tmp/some-run");
  BOOST_TEST(env->launcher_pid == 4242);
  BOOST_TEST(!env->use_agent_store);
}

BOOST_AUTO_TEST_CASE(trainloop_variables_win_over_torchrun_and_slurm) {
  set(kSlurmVars);
  set(kTorchrunVars);
  set(kTrainloopVars);
  BOOST_TEST((distributed::detect_rank_env()->source == RankEnvSource::Trainloop));
  ::unsetenv("TRAINLOOP_RANK");
  BOOST_TEST((distributed::detect_rank_env()->source == RankEnvSource::Torchrun));
  ::unsetenv("RANK");
  BOOST_TEST((distributed::detect_rank_env()->source == RankEnvSource::Slurm));
}

BOOST_AUTO_TEST_CASE(missing_trainloop_variable_is_named) {
  set(kTrainloopVars);
  ::unsetenv("TRAINLOOP_MASTER_PORT");
  std::string message = detect_error();
  BOOST_TEST(contains(message, "TRAINLOOP_MASTER_PORT is not set"), message);
}

BOOST_AUTO_TEST_CASE(torchrun_variables_are_read) {
  set(kTorchrunVars);
  set({{"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST((env->source == RankEnvSource::Torchrun));
  BOOST_TEST(env->rank == 3);
  BOOST_TEST(env->world_size == 4);
  BOOST_TEST(env->local_rank == 1);
  BOOST_TEST(env->local_world_size == 2);
  BOOST_TEST(env->node_rank == 1);
  BOOST_TEST(env->master_addr == "node0");
  BOOST_TEST(env->master_port == 29400);
  BOOST_TEST(env->use_agent_store);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);
  BOOST_TEST(!distributed::detect_rank_env()->use_agent_store);
}

BOOST_AUTO_TEST_CASE(plain_env_init_without_local_variables_is_one_node) {
  set({{"RANK", "2"}, {"WORLD_SIZE", "3"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}});
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST(env->local_rank == 2);
  BOOST_TEST(env->local_world_size == 3);
  BOOST_TEST(env->node_rank == 0);
}

BOOST_AUTO_TEST_CASE(malformed_values_name_variable_and_value) {
  set(kTorchrunVars);
  ::setenv("RANK", "abc", 1);
  std::string message = detect_error();
  BOOST_TEST(contains(message, "RANK='abc'"), message);

  ::setenv("RANK", "4", 1);  // == WORLD_SIZE
  message = detect_error();
  BOOST_TEST(contains(message, "RANK=4"), message);
  BOOST_TEST(contains(message, "WORLD_SIZE=4"), message);

  ::setenv("RANK", "3", 1);
  ::setenv("MASTER_PORT", "70000", 1);
  message = detect_error();
  BOOST_TEST(contains(message, "MASTER_PORT=70000"), message);

  ::setenv("MASTER_PORT", "29400", 1);
  ::setenv("LOCAL_RANK", "2", 1);  // == LOCAL_WORLD_SIZE
  message = detect_error();
  BOOST_TEST(contains(message, "LOCAL_RANK=2"), message);

  ::setenv("LOCAL_RANK", "1", 1);
  ::setenv("WORLD_SIZE", "4x", 1);
  message = detect_error();
  BOOST_TEST(contains(message, "WORLD_SIZE='4x'"), message);
}

BOOST_AUTO_TEST_CASE(slurm_variables_are_read_with_derived_master) {
  set(kSlurmVars);
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST((env->source == RankEnvSource::Slurm));
  BOOST_TEST(env->rank == 5);
  BOOST_TEST(env->world_size == 8);
  BOOST_TEST(env->local_rank == 1);
  BOOST_TEST(env->local_world_size == 2);
  BOOST_TEST(env->node_rank == 2);
  BOOST_TEST(env->master_addr == "gpu03");
  BOOST_TEST(env->master_port == 15000 + 123456 % 10000);

  set({{"MASTER_ADDR", "head"}, {"MASTER_PORT", "29999"}});
  env = distributed::detect_rank_env();
  BOOST_TEST(env->master_addr == "head");
  BOOST_TEST(env->master_port == 29999);
}

BOOST_AUTO_TEST_CASE(slurm_compressed_tasks_per_node) {
  set(kSlurmVars);
  ::unsetenv("SLURM_NTASKS_PER_NODE");
  set({{"SLURM_NTASKS", "7"}, {"SLURM_TASKS_PER_NODE", "2(x3),1"}, {"SLURM_NODEID", "3"},
       {"SLURM_PROCID", "6"}, {"SLURM_LOCALID", "0"}});
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST(env->local_world_size == 1);
  ::setenv("SLURM_NODEID", "1", 1);
  ::setenv("SLURM_PROCID", "3", 1);
  ::setenv("SLURM_LOCALID", "1", 1);
  BOOST_TEST(distributed::detect_rank_env()->local_world_size == 2);
  ::setenv("SLURM_NODEID", "4", 1);  // only 4 nodes listed
  std::string message = detect_error();
  BOOST_TEST(contains(message, "SLURM_NODEID=4"), message);
}

BOOST_AUTO_TEST_CASE(slurm_without_step_is_not_a_rank) {
  set(kSlurmVars);
  ::unsetenv("SLURM_STEP_ID");  // a bare salloc / sbatch shell
  BOOST_TEST(!distributed::detect_rank_env().has_value());
}

BOOST_AUTO_TEST_CASE(slurm_default_port_without_job_id) {
  set(kSlurmVars);
  ::unsetenv("SLURM_JOB_ID");
  BOOST_TEST(distributed::detect_rank_env()->master_port == 29500);
  ::setenv("SLURM_JOB_ID", "12a", 1);
  std::string message = detect_error();
  BOOST_TEST(contains(message, "SLURM_JOB_ID='12a'"), message);
}

BOOST_AUTO_TEST_CASE(slurm_nodelist_forms) {
  BOOST_TEST(distributed::slurm_first_host("node7") == "node7");
  BOOST_TEST(distributed::slurm_first_host("host1,host2") == "host1");
  BOOST_TEST(distributed::slurm_first_host("prefix[1-3,5]") == "prefix1");
  BOOST_TEST(distributed::slurm_first_host("prefix[5,1-3]") == "prefix5");
  BOOST_TEST(distributed::slurm_first_host("gpu[003-005],cpu[1-2]") == "gpu003");
  BOOST_TEST(distributed::slurm_first_host("rack[1-2]-n[4,6]") == "rack1-n4");
  BOOST_CHECK_THROW(distributed::slurm_first_host("prefix[1-3"), trainloop::Error);
  BOOST_CHECK_THROW(distributed::slurm_first_host(""), trainloop::Error);
}

BOOST_AUTO_TEST_CASE(slurm_nodelist_fallbacks) {
  set(kSlurmVars);
  ::unsetenv("SLURM_JOB_NODELIST");
  set({{"SLURM_NODELIST", "a,b"}});
  BOOST_TEST(distributed::detect_rank_env()->master_addr == "a");
  set({{"SLURM_STEP_NODELIST", "step[7-8]"}});  // the step's own nodes win
  BOOST_TEST(distributed::detect_rank_env()->master_addr == "step7");
}

BOOST_AUTO_TEST_CASE(openmpi_variables_are_read) {
  set({{"OMPI_COMM_WORLD_RANK", "6"}, {"OMPI_COMM_WORLD_SIZE", "8"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"},
       {"MASTER_ADDR", "mpi-head"}, {"MASTER_PORT", "29600"}});
  auto env = distributed::detect_rank_env();
  BOOST_REQUIRE(env.has_value());
  BOOST_TEST((env->source == RankEnvSource::OpenMPI));
  BOOST_TEST(env->rank == 6);
  BOOST_TEST(env->world_size == 8);
  BOOST_TEST(env->local_rank == 2);
  BOOST_TEST(env->local_world_size == 4);
  BOOST_TEST(env->node_rank == 1);
  BOOST_TEST(env->master_addr == "mpi-head");
  BOOST_TEST(env->master_port == 29600);
}

BOOST_AUTO_TEST_CASE(openmpi_without_master_is_a_clear_error) {
  set({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "2"},
       {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}});
  std::string message = detect_error();
  BOOST_TEST(contains(message, "MASTER_ADDR is not set"), message);
  BOOST_TEST(contains(message, "mpirun -x MASTER_ADDR"), message);
  set({{"MASTER_ADDR", "h"}});
  message = detect_error();
  BOOST_TEST(contains(message, "MASTER_PORT is not set"), message);
  set({{"MASTER_PORT", "-1"}});
  message = detect_error();
  BOOST_TEST(contains(message, "MASTER_PORT=-1"), message);
}

BOOST_AUTO_TEST_CASE(openmpi_on_one_machine_needs_no_master_variables) {
  // Open MPI 4 names the job in OMPI_MCA_ess_base_jobid (as `mpirun -np 2 env` shows on Debian 12).
  set({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_MCA_ess_base_jobid", "872742913"}});
  auto rank1 = distributed::detect_rank_env();
  BOOST_REQUIRE(rank1.has_value());
  BOOST_TEST(rank1->master_addr == "127.0.0.1");
  BOOST_TEST(rank1->master_port >= 20000);
  BOOST_TEST(rank1->master_port < 30000);
  set({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  BOOST_TEST(distributed::detect_rank_env()->master_port == rank1->master_port);  // every rank derives it alike
  set({{"OMPI_MCA_ess_base_jobid", "872742914"}});  // the next job on this machine
  BOOST_TEST(distributed::detect_rank_env()->master_port != rank1->master_port);
  ::unsetenv("OMPI_MCA_ess_base_jobid");  // Open MPI 5 (PRRTE) names it in PMIX_NAMESPACE
  set({{"PMIX_NAMESPACE", "prterun-vm-4242@1"}});
  auto five = distributed::detect_rank_env();
  BOOST_TEST(five->master_addr == "127.0.0.1");
  BOOST_TEST(five->master_port >= 20000);
  set({{"MASTER_ADDR", "10.0.0.7"}, {"MASTER_PORT", "29601"}});  // the user's choice wins
  BOOST_TEST(distributed::detect_rank_env()->master_addr == "10.0.0.7");
  BOOST_TEST(distributed::detect_rank_env()->master_port == 29601);
}

BOOST_AUTO_TEST_CASE(openmpi_across_machines_still_asks_for_master_variables) {
  set({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
       {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}, {"OMPI_MCA_ess_base_jobid", "872742913"}});
  const std::string message = detect_error();
  BOOST_TEST(contains(message, "MASTER_ADDR is not set"), message);
  BOOST_TEST(contains(message, "across machines"), message);
}

BOOST_AUTO_TEST_SUITE_END()

BOOST_AUTO_TEST_SUITE(free_port)

/// Binds and listens on 127.0.0.1:port; returns the descriptor (or -1).
int listen_on(int port) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(static_cast<uint16_t>(port));
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 || ::listen(fd, 1) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

BOOST_AUTO_TEST_CASE(found_port_can_be_bound) {
  int port = distributed::find_free_port();
  BOOST_TEST(port >= 1);
  BOOST_TEST(port <= 65535);
  BOOST_CHECK_NO_THROW(distributed::check_port_available("127.0.0.1", port));
  int fd = listen_on(port);
  BOOST_TEST(fd >= 0);
  ::close(fd);
  BOOST_TEST(distributed::find_free_port("localhost") >= 1);
}

BOOST_AUTO_TEST_CASE(port_in_use_is_reported_with_its_number) {
  int port = distributed::find_free_port();
  int fd = listen_on(port);
  BOOST_REQUIRE(fd >= 0);
  std::string message;
  try {
    distributed::check_port_available("127.0.0.1", port);
  } catch (const trainloop::Error& error) {
    message = error.what();
  }
  ::close(fd);
  BOOST_TEST(contains(message, "port " + std::to_string(port) +
                                   " on 127.0.0.1 is already in use; pass another master port "
                                   "or 0 to pick a free one"),
             message);
  BOOST_CHECK_NO_THROW(distributed::check_port_available("127.0.0.1", port));  // free again
}

BOOST_AUTO_TEST_CASE(bad_port_or_host_is_rejected) {
  BOOST_CHECK_THROW(distributed::check_port_available("127.0.0.1", 0), trainloop::Error);
  BOOST_CHECK_THROW(distributed::check_port_available("127.0.0.1", 65536), trainloop::Error);
  BOOST_CHECK_THROW(distributed::find_free_port("no-such-host.invalid"), trainloop::Error);
}

BOOST_AUTO_TEST_CASE(a_kill_plan_is_read_whole_and_a_bad_one_is_named) {
  // TRAINLOOP_TEST_KILL_AT (tests' kill hook): a typo must fail the test naming it, not run without the kill.
  using trainloop::progress::KillPoint;
  using trainloop::progress::detail::parse_one_kill_plan;
  const auto [rank, at] = parse_one_kill_plan("12:34:share-copy@2");
  BOOST_TEST(rank == 12);
  BOOST_TEST(at.step == 34);
  BOOST_TEST((at.point == KillPoint::ShareCopy));
  BOOST_TEST(at.generation == 2);
  BOOST_TEST(parse_one_kill_plan("1:3:hand-off").second.generation == -1);
  const std::pair<const char*, const char*> bad[] = {
      {"1:3", "has fewer than two ':'"},
      {"1:3:forwards", "names the point 'forwards'; expected forward, backward"},
      {"1:x:forward", "step='x' is not an integer"},
      {"1:0:forward", "step=0 is out of range"},
      {"one:3:forward", "rank='one' is not an integer"},
      {"1:3:forward@", "generation='' is not an integer"},
      {"1:3:forward@x", "generation='x' is not an integer"}};
  for (const auto& [plan, expected] : bad) {
    std::string message;
    try {
      parse_one_kill_plan(plan);
    } catch (const trainloop::Error& error) {
      message = error.what();
    }
    BOOST_TEST(contains(message, std::string("TRAINLOOP_TEST_KILL_AT's plan '") + plan + "'"), plan << ": " << message);
    BOOST_TEST(contains(message, expected), plan << ": " << message);
  }
}

BOOST_AUTO_TEST_SUITE_END()
