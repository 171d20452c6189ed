// Trains a small CNN on Fashion-MNIST (Debian's dataset-fashion-mnist) with trainloop and prints
// the final test accuracy. The training mode is chosen at run time: --gpu-mode single|dp|ddp.
//
//   fashion_mnist --epochs 4 --batch-size 64 --device cpu --data /usr/share/datasets/fashion-mnist

#include "fashion_net.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"Train a CNN on Fashion-MNIST with trainloop"};
  std::string gpu_mode = "single";
  int64_t epochs = 4;
  int64_t batch_size = 64;
  std::string device = "cpu";
  std::string data_dir = trainloop::data::FashionMNISTOptions().root().string();
  double learning_rate = 1e-3;
  int64_t workers = 0;
  uint64_t seed = 0;
  std::string history_csv;
  int procs = 0;
  int replicas = 2;
  app.add_option("--gpu-mode", gpu_mode, "single, dp or ddp");
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch (per rank in ddp)");
  app.add_option("--device", device, "cpu or cuda:N");
  app.add_option("--data", data_dir, "directory with the Fashion-MNIST *-idx?-ubyte.gz files");
  app.add_option("--lr", learning_rate, "Adam learning rate");
  app.add_option("--workers", workers, "background loader threads");
  app.add_option("--seed", seed, "seed for weights and shuffling");
  app.add_option("--history", history_csv, "write the per-epoch history to this CSV file");
  app.add_option("--procs", procs, "ddp: processes on this machine (0: one per GPU, or 2 on the CPU)");
  app.add_option("--replicas", replicas, "dp on the CPU: number of model replicas");
  CLI11_PARSE(app, argc, argv);

  try {
    // The mode is chosen at run time; every mode then runs the same compiled loop.
    trainloop::gpu_mode::Any mode = trainloop::gpu_mode::parse(gpu_mode);
    const torch::Device chosen_device(device);
    std::visit(
        [&](auto& policy) {
          using Policy = std::decay_t<decltype(policy)>;
          if constexpr (std::is_same_v<Policy, trainloop::gpu_mode::Single>) {
            policy.device(chosen_device);
          } else if constexpr (std::is_same_v<Policy, trainloop::gpu_mode::DataParallel>) {
            if (chosen_device.is_cpu()) policy = trainloop::gpu_mode::DataParallel::cpu_replicas(replicas);
          } else {
            policy.device_type(chosen_device.type()).procs_per_node(procs);
          }
        },
        mode.get());
    using trainloop::data::FashionMNIST;
    FashionMNIST train(FashionMNIST::Split::Train, data_dir);
    FashionMNIST test(FashionMNIST::Split::Test, data_dir);

    torch::manual_seed(seed);
    FashionNet net;
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(learning_rate));
    trainloop::TrainLoop<FashionNet, trainloop::gpu_mode::Any> loop(
        net, train, test, optimizer, torch::nn::CrossEntropyLoss(),
        trainloop::TrainLoopOptions().batch_size(batch_size).num_workers(workers).seed(seed).metrics(
            {std::make_shared<trainloop::Accuracy>()}),
        mode);

    trainloop::CallbackList callbacks{std::make_shared<trainloop::ProgressBar>()};
    if (!history_csv.empty()) callbacks.push_back(std::make_shared<trainloop::CsvLogger>(history_csv));
    auto history = loop.fit(epochs, callbacks);

    double seconds = 0;
    for (const auto& epoch : history.epochs) seconds += epoch.seconds;
    const auto& result = *history.last().validation;
    std::cout << mode.name() << ": test accuracy " << result.metrics.at("accuracy") << " (loss " << result.loss << ", "
              << result.samples << " test images) after " << history.epochs.size() << " epochs, "
              << seconds << " s of training\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
