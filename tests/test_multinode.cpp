#define BOOST_TEST_MODULE test_multinode
#include "unit_test.hpp"

#include "test_paths.hpp"

#include "ddp_test_model.hpp"

#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <iostream>

namespace fs = std::filesystem;

namespace {

/// Runs a shell command, returning its exit status and output.
std::pair<int, std::string> shell(const std::string& command) {
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
};

}  // namespace

BOOST_AUTO_TEST_CASE(two_nodes_in_network_namespaces_train_as_one_job) {
  TwoNodeNetwork network;
  if (!network.ready) {
    // ctest reports the program as Skipped on this marker (SKIP_REGULAR_EXPRESSION), not Passed.
    std::cout << "TRAINLOOP_TEST_SKIPPED: network namespaces cannot be created here (needs root and iproute2): "
              << network.error << std::endl;
    return;
  }
  auto dir = fs::temp_directory_path() / ("trainloop_multinode_" + network.suffix);
  fs::remove_all(dir);
  fs::create_directories(dir / "node0");
  fs::create_directories(dir / "node1");
  // Each node starts its own ranks (1 per node here: world 2) with the same master address and port.
  auto node = [&](int rank, const std::string& ns, const std::string& interface) {
    return "ip netns exec " + ns + " env TL_TEST_NNODES=2 TL_TEST_NODE_RANK=" + std::to_string(rank) +
           " TL_TEST_MASTER_ADDR=" + network.addr0 + " GLOO_SOCKET_IFNAME=" + interface + " " + test_program("ddp_worker") +
           " train 1 " + (dir / ("node" + std::to_string(rank))).string() + " 29731";
  };
  auto [status, output] = shell("(" + node(0, network.ns0, network.if0) + " & " + node(1, network.ns1, network.if1) +
                                "; s1=$?; wait %1; s0=$?; exit $((s0 + s1)))");
  BOOST_TEST_MESSAGE(output);
  BOOST_REQUIRE_EQUAL(status, 0);
  auto node0 = load_params((dir / "node0" / "params.pt").string());
  auto node1 = load_params((dir / "node1" / "params.pt").string());
  BOOST_TEST(torch::equal(node0, node1));  // each machine's caller got the same trained model
  auto difference = (node0 - reference_params(2, 1)).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |two nodes - one process with batch 8| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  fs::remove_all(dir);
}
