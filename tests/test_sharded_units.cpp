// Sharded gradients and parameters as parts (distributed/zero/): two thread-ranks of one process
// each run a sharded model — what the engine does per micro-batch and step — against one model
// trained on the whole batch. This program is compiled without NDEBUG (tests/CMakeLists.txt): the
// gather mode works in a debug build, and two sharded fits run at once in one process.
#define BOOST_TEST_MODULE test_sharded_units
#include "unit_test.hpp"

#include "thread_ranks.hpp"

#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/unit_gather_mode.hpp>
#include <trainloop/distributed/zero/unit_gradients.hpp>
#include <trainloop/distributed/zero/unit_parameters.hpp>
#include <trainloop/distributed/zero/units.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>

#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace distributed = trainloop::distributed;

#ifdef NDEBUG
#error "test_sharded_units must be compiled without NDEBUG: it is the proof that full sharding works in a debug build"
#endif

namespace {

struct OneThreadPerRank {
  OneThreadPerRank() { torch::set_num_threads(1); }
};
BOOST_TEST_GLOBAL_FIXTURE(OneThreadPerRank);

struct NetImpl : torch::nn::Module {
  NetImpl() {
    static std::mutex seeding;  // thread-ranks build their models at once: one seeded construction at a time
    std::lock_guard<std::mutex> lock(seeding);
    torch::manual_seed(7);
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    fc3 = register_module("fc3", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::tanh(fc2(torch::tanh(fc1(x))))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
};
TORCH_MODULE(Net);

/// The loss: cross-entropy plus a small penalty read by one operator over all three units' weights
/// (torch::cat), so one operator needs three units whole at once: both slots and memory of its own.
torch::Tensor loss_of(Net& net, const torch::Tensor& x, const torch::Tensor& y) {
  const torch::Tensor all = torch::cat({net->fc1->weight.flatten(), net->fc2->weight.flatten(), net->fc3->weight.flatten()});
  return torch::nn::functional::cross_entropy(net(x), y) + 1e-3 * all.square().sum();
}

constexpr int kWorld = 2;
constexpr int kSteps = 3;
constexpr int64_t kPerRank = 8;

torch::Tensor inputs() { return torch::randn({kWorld * kPerRank, 6}, at::detail::createCPUGenerator(3)); }
torch::Tensor targets() { return torch::randint(0, 3, {kWorld * kPerRank}, at::detail::createCPUGenerator(4)); }

/// One model trained on the whole batch: what every sharded rank must end with.
std::vector<torch::Tensor> whole_batch_reference() {
  Net net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    sgd.zero_grad();
    loss_of(net, inputs(), targets()).backward();
    sgd.step();
  }
  std::vector<torch::Tensor> values;
  for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
  return values;
}

/// What the sharded engine does on rank `group.rank()`: the units (the model's children) laid
/// out, its half of every batch forward and backward in the gather mode, the reduced chunks
/// stepped, the units freed; at the end every parameter whole again.
std::vector<torch::Tensor> train_sharded(distributed::ProcessGroup& group, bool full) {
  Net net;
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const auto units = distributed::assign_units(*net, {});
  const auto layout = std::make_shared<const distributed::FlatLayout>(sgd, group.world_size(), units.unit_of);
  std::vector<torch::Tensor> chunks;
  for (size_t u = 0; u < layout->unit_count() && full; ++u) chunks.push_back(torch::zeros({layout->unit_chunk(u)}));
  distributed::ZeroOptimizerShard zero(layout, group.rank(), chunks);
  distributed::UnitGradients gradients(layout, group);
  std::optional<distributed::UnitParameters> parameters;
  if (full) parameters.emplace(layout, group, chunks);
  const torch::Tensor x = inputs().narrow(0, group.rank() * kPerRank, kPerRank);
  const torch::Tensor y = targets().narrow(0, group.rank() * kPerRank, kPerRank);
  for (int step = 0; step < kSteps; ++step) {
    gradients.begin_micro_batch(/*synchronize=*/true);
    if (parameters) parameters->begin_micro_batch();
    {
      std::optional<distributed::UnitGatherScope> gathering;
      if (parameters) gathering.emplace(*parameters);
      loss_of(net, x, y).backward();
    }
    if (parameters) parameters->free_all();
    gradients.finalize();
    zero.pieces_with_gradients(gradients.chunks());
    zero.step_pieces(sgd);
    if (!full) zero.broadcast_pieces(group);
    for (auto& p : net->parameters()) p.mutable_grad().reset();
  }
  if (parameters) parameters->release(/*communicate=*/true);
  std::vector<torch::Tensor> values;
  for (const auto& p : net->parameters()) values.push_back(p.detach().clone());
  return values;
}

double max_difference(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double most = 0.0;
  for (size_t i = 0; i < a.size(); ++i) most = std::max(most, (a[i] - b[i]).abs().max().item<double>());
  return most;
}

}  // namespace

// Both levels, two thread-ranks of one process at once (two sharded fits side by side, each
// finding its own units by storage), equal the whole batch on one model to float rounding (the
// reduce-scatter sums two halves' means where the reference takes one mean).
BOOST_AUTO_TEST_CASE(two_sharded_ranks_in_one_process_equal_the_whole_batch_at_gradients_and_full) {
  const auto reference = whole_batch_reference();
  for (bool full : {false, true}) {
    std::vector<std::vector<torch::Tensor>> trained(kWorld);
    run_ranks(kWorld, [&](distributed::ProcessGroup& group) { trained[group.rank()] = train_sharded(group, full); });
    for (int r = 0; r < kWorld; ++r) {
      const double difference = max_difference(trained[r], reference);
      BOOST_TEST_MESSAGE((full ? "full" : "gradients") << ", rank " << r << ": max |sharded - whole batch| " << difference);
      BOOST_TEST(difference < 1e-6, (full ? "full" : "gradients") << ", rank " << r << ": " << difference);
    }
    BOOST_TEST(max_difference(trained[0], trained[1]) == 0.0);  // the ranks agree exactly
  }
}

// A gather that fails (the other rank is gone) throws from the operator that needed the unit —
// during the forward, before any later operator or backward ran — and this rank's chunks (the
// only copy of its share) are unchanged: nothing computed on NaN, nothing reported late.
BOOST_AUTO_TEST_CASE(a_failed_gather_throws_from_the_operator_that_needed_the_unit_and_keeps_the_chunks) {
  std::atomic<bool> forward_finished{false};
  std::string error;
  double chunk_change = -1.0;
  auto errors = run_ranks_collecting(kWorld, [&](distributed::ProcessGroup& group) {
    if (group.rank() == 1) return;  // gone: its group closes, rank 0's first gather fails
    Net net;
    torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
    const auto layout = std::make_shared<const distributed::FlatLayout>(sgd, group.world_size(),
                                                                        distributed::assign_units(*net, {}).unit_of);
    std::vector<torch::Tensor> chunks;
    for (size_t u = 0; u < layout->unit_count(); ++u) chunks.push_back(torch::zeros({layout->unit_chunk(u)}));
    distributed::UnitParameters parameters(layout, group, chunks);
    parameters.begin_micro_batch();
    std::vector<torch::Tensor> before;
    for (const auto& chunk : chunks) before.push_back(chunk.clone());
    try {
      distributed::UnitGatherScope gathering(parameters);
      net(inputs());
      forward_finished = true;
    } catch (const std::exception& e) {
      error = e.what();
    }
    chunk_change = 0.0;
    for (size_t u = 0; u < chunks.size(); ++u) chunk_change = std::max(chunk_change, (chunks[u] - before[u]).abs().max().item<double>());
    parameters.release(/*communicate=*/false);
  });
  BOOST_TEST(!errors[0]);
  BOOST_TEST(!forward_finished.load());
  BOOST_TEST_MESSAGE("the failed gather: " << error);
  BOOST_TEST(!error.empty());
  BOOST_TEST(chunk_change == 0.0);
}
