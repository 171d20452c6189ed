#define BOOST_TEST_MODULE test_multinode
#include "unit_test.hpp"

#include "test_paths.hpp"

#include "ddp_test_model.hpp"
#include "two_node_network.hpp"

#include <filesystem>
#include <iostream>

namespace fs = std::filesystem;

namespace {

using trainloop_test::shell;
using trainloop_test::TwoNodeNetwork;

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
  auto node = [&](int rank, const std::string& ns) {
    return "ip netns exec " + ns + " env " + network.node_env(rank) + " " + test_program("ddp_worker") + " train 1 " +
           (dir / ("node" + std::to_string(rank))).string() + " 29731";
  };
  auto [status, output] = shell("(" + node(0, network.ns0) + " & " + node(1, network.ns1) +
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
