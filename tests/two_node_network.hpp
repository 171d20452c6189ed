#pragma once
// Two "machines" on this one: network namespaces joined by a veth pair (test_multinode), and for
// jobs that must not share a machine's memory (test_elastic's several-machine cases) each node's
// processes also get their own host name and /dev/shm (a mount and UTS namespace with a tmpfs):
// trainloop tells machines apart by boot id, host name and pid namespace, and keeps elastic
// training's hand-offs in /dev/shm. Needs root and iproute2; the tests say Skipped without them.


#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <string>
#include <utility>

namespace trainloop_test {

/// Runs a shell command, returning its exit status and output (stdout and stderr).
inline std::pair<int, std::string> shell(const std::string& command) {
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
  int status = ::pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

/// Two network namespaces ("machines") joined by a veth pair, removed again on destruction.
struct TwoNodeNetwork {
  std::string suffix = std::to_string(::getpid() % 100000);
  std::string ns0 = "tl0_" + suffix, ns1 = "tl1_" + suffix;
  std::string if0 = "tlv0_" + suffix, if1 = "tlv1_" + suffix;
  std::string addr0 = "192.168.77.1", addr1 = "192.168.77.2";
  bool ready = false;
  std::string error;

  TwoNodeNetwork() {
    auto [status, output] = shell(
        "set -e; ip netns add " + ns0 + "; ip netns add " + ns1 + "; ip link add " + if0 + " type veth peer name " +
        if1 + "; ip link set " + if0 + " netns " + ns0 + "; ip link set " + if1 + " netns " + ns1 +
        "; ip -n " + ns0 + " addr add " + addr0 + "/24 dev " + if0 + "; ip -n " + ns1 + " addr add " + addr1 +
        "/24 dev " + if1 + "; for n in " + ns0 + " " + ns1 + "; do ip -n $n link set lo up; done; ip -n " + ns0 +
        " link set " + if0 + " up; ip -n " + ns1 + " link set " + if1 + " up");
    ready = status == 0;
    error = output;
  }
  ~TwoNodeNetwork() { shell("ip netns del " + ns0 + "; ip netns del " + ns1); }

  /// Whether nodes can also have their own host name and /dev/shm (machine()).
  bool machines_ready() {
    auto [status, output] = shell("unshare --mount --uts sh -c 'hostname tl-probe && mount -t tmpfs tmpfs /dev/shm'");
    if (status != 0) error = output;
    return ready && status == 0;
  }

  /// `command` run as on machine `node` (0 or 1): in its network namespace, with its own host name
  /// and its own empty /dev/shm; when it ends, the number of elastic hand-off files left in that
  /// /dev/shm goes to the file `left`. Its exit status is the command's.
  std::string machine(int node, const std::string& command, const std::filesystem::path& left) const {
    return "ip netns exec " + (node == 0 ? ns0 : ns1) + " unshare --mount --uts sh -c 'hostname tl-machine" +
           std::to_string(node) + " && mount -t tmpfs -o size=1g tmpfs /dev/shm && " + command +
           "; s=$?; ls /dev/shm | grep -c ^trainloop-elastic- > " + left.string() + "; exit $s'";
  }

  /// The environment that makes ddp_worker node `node` of 2 (its ranks: `per_node` from node * per_node).
  std::string node_env(int node) const {
    return "TL_TEST_NNODES=2 TL_TEST_NODE_RANK=" + std::to_string(node) + " TL_TEST_MASTER_ADDR=" + addr0 +
           " GLOO_SOCKET_IFNAME=" + (node == 0 ? if0 : if1);
  }
};

}  // namespace trainloop_test
