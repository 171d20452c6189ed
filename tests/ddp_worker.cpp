// A program that trains with gpu_mode::DistributedDataParallel, driven by test_distributed.
// fit() re-executes this program once per rank, exactly as it does for a user's program.
//
//   ddp_worker <scenario> <world> <out-dir> [port]
//
// Scenarios: train (equivalence), accumulate, eval97, eval99, throw, sigkill, join.
// It writes <out-dir>/params.pt (the trained parameters, as the caller's model holds them after
// fit()) and <out-dir>/result.txt (numbers the test compares), and exits 3 on a trainloop::Error
// after printing its message.

#include "ddp_test_model.hpp"

#include <csignal>
#include <fstream>
#include <iostream>

namespace tl = trainloop;

/// Fails one rank on purpose, from inside training.
struct FailOnRank : tl::Callback {
  std::string how;
  explicit FailOnRank(std::string h) : how(std::move(h)) {}
  void on_batch_end(tl::TrainState& state) override {
    const char* rank = std::getenv("TRAINLOOP_RANK");
    if (!rank || std::string(rank) != "1") return;
    if (how == "throw" && state.epoch == 2 && state.batch == 2) throw std::runtime_error("rank one gave up in epoch 2");
    if (how == "sigkill" && state.epoch == 1 && state.batch == 3) std::raise(SIGKILL);
  }
};

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: ddp_worker <scenario> <world> <out-dir> [port]\n";
    return 2;
  }
  const std::string scenario = argv[1];
  const int world = std::stoi(argv[2]);
  const std::string out_dir = argv[3];
  const int port = argc > 4 ? std::stoi(argv[4]) : 0;
  try {
    torch::manual_seed(5);
    Mlp net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    auto mode = tl::gpu_mode::DistributedDataParallel()
                    .procs_per_node(world)
                    .device_type(torch::kCPU)
                    .master_port(port)
                    .timeout(std::chrono::seconds(20))
                    .first_bucket_cap_bytes(256)  // several buckets even for a small model
                    .bucket_cap_bytes(1024);
    auto options = tl::TrainLoopOptions().batch_size(4).shuffle(false).metrics({std::make_shared<tl::Accuracy>()});
    // Multi-node runs (test_multinode) say where this "machine" sits; `world` is then per node.
    const int nnodes = std::getenv("TL_TEST_NNODES") ? std::stoi(std::getenv("TL_TEST_NNODES")) : 1;
    if (nnodes > 1) {
      mode.nnodes(nnodes).node_rank(std::stoi(std::getenv("TL_TEST_NODE_RANK"))).master_addr(std::getenv("TL_TEST_MASTER_ADDR"));
    }
    const int total_world = world * nnodes;
    int64_t train_size = 4 * total_world * 5, epochs = 1, val_size = 40;
    tl::CallbackList callbacks;
    if (scenario == "accumulate") options.grad_accumulation_steps(2), train_size *= 2;
    if (scenario == "eval97" || scenario == "eval99") {
      train_size = val_size = scenario == "eval97" ? 97 : 99;
      options.batch_size(8).shuffle(true);
      epochs = 2;
    }
    if (scenario == "throw" || scenario == "sigkill") {
      callbacks.push_back(std::make_shared<FailOnRank>(scenario));
      epochs = 3;
      mode.timeout(std::chrono::seconds(60));  // failure must be caught by the launcher, not a timeout
    }
    auto train = make_data(train_size, 1);
    auto val = make_data(val_size, 2);
    tl::TrainLoop<Mlp, tl::gpu_mode::DistributedDataParallel> loop(net, train, val, optimizer,
                                                                   torch::nn::CrossEntropyLoss(), options, mode);
    auto history = loop.fit(epochs, callbacks);
    if (scenario == "twofits") {
      // A second fit() continues from the first one's weights and optimizer state. The ranks of
      // this second launch pass the first fit() again, and get its History back.
      const auto first_steps = history.last().steps;
      history = loop.fit(epochs, callbacks);
      history.total_steps += first_steps;
    }

    // Only one process gets here per job: the launching one (or each rank, when joined by torchrun).
    std::vector<torch::Tensor> params;
    for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
    torch::save(params, out_dir + "/params" + (std::getenv("RANK") ? std::string(std::getenv("RANK")) : "") + ".pt");
    if (tl::is_main_process()) {
      // Evaluate the returned model in this one process: must equal the ranks' reduced values.
      tl::TrainLoop<Mlp> local(net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), options);
      auto check = local.evaluate(val);
      std::ofstream out(out_dir + "/result.txt");
      out.precision(17);
      out << "steps " << history.total_steps << "\nepochs " << history.epochs.size() << "\nval_loss "
          << history.last().validation->loss << "\nval_accuracy " << history.last().validation->metrics.at("accuracy")
          << "\nval_samples " << history.last().validation->samples << "\nlocal_val_loss " << check.loss
          << "\nlocal_val_accuracy " << check.metrics.at("accuracy") << "\ntrain_samples " << history.last().samples
          << "\n";
    }
    return 0;
  } catch (const tl::Error& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 3;
  }
}
