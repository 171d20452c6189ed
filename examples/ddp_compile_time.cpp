// DistributedDataParallel chosen at compile time: the mode is a type, so the loop is compiled for
// it alone. Run it as a plain program (it starts its ranks itself) or under torchrun:
//
//   ddp_compile_time --procs 2 --epochs 2
//   torchrun --nproc-per-node 2 --no-python ddp_compile_time --epochs 2
//
// rank0_first() and is_main_process() show the helpers for code outside the loop.

#include "fashion_net.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"Fashion-MNIST with gpu_mode::DistributedDataParallel fixed at compile time"};
  int procs = 2;
  int64_t epochs = 2;
  int64_t batch_size = 64;
  std::string data_dir = trainloop::data::FashionMNISTOptions().root().string();
  app.add_option("--procs", procs, "processes (ranks) on this machine");
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch on each rank");
  app.add_option("--data", data_dir, "directory with the Fashion-MNIST files");
  CLI11_PARSE(app, argc, argv);

  try {
    using trainloop::data::FashionMNIST;
    // Rank 0 reads (and would download or unpack) first; the others follow once it is done.
    auto train = trainloop::rank0_first([&] { return FashionMNIST(FashionMNIST::Split::Train, data_dir); });
    FashionMNIST test(FashionMNIST::Split::Test, data_dir);
    if (trainloop::is_main_process()) std::cout << "training on " << train.size().value() << " images\n";

    torch::manual_seed(0);
    FashionNet net;
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-3));
    using Mode = trainloop::gpu_mode::DistributedDataParallel;
    trainloop::TrainLoop loop(  // TrainLoop<FashionNet, Mode>: the mode's type is the loop's, fixed at compile time
        net, train, test, optimizer, torch::nn::CrossEntropyLoss(),
        trainloop::TrainLoopOptions().batch_size(batch_size).metrics({trainloop::Accuracy()}),
        Mode().procs_per_node(procs).device_type(torch::kCPU));
    auto history = loop.fit(epochs, {std::make_shared<trainloop::ProgressBar>()});
    if (trainloop::is_main_process())
      std::cout << "test accuracy " << history.validation("accuracy") << '\n';
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
