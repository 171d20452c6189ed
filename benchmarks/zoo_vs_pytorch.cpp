// zoo_vs_pytorch (trainloop side): training throughput of a model of the zoo (resnet18,
// resnet50, ...) in single or ddp, to compare with Python PyTorch training torchvision's same
// model with the same loop (benchmarks/zoo_vs_pytorch.py; benchmarks/run_zoo_vs_pytorch.sh
// alternates them and reports medians).
//
//   zoo_vs_pytorch --arch resnet18 --size 64 --batch-size 32 --steps 20 --epochs 2 --mode single
//
// The work, identical in both programs: synthetic in-memory images (N(0,1), 3 x size x size,
// 10 classes) of ranks * batch * steps samples, no shuffling, SGD(lr 0.01, momentum 0.9),
// cross-entropy, no validation and no metrics; --precision bf16 (autocast) and --memory-format
// channels-last as the Python side's same flags. single: 2 intra-op threads (trainloop's default on
// this 2-core machine); ddp: `--ranks` processes of 1 thread each over Gloo. Epoch 1 is a warm-up;
// the figure is the last epoch's samples/s (all ranks' samples over the epoch's training time).
//
// Output (from the launching process only): one line per epoch, then
//   RESULT trainloop samples_per_second <value>

#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

namespace tl = trainloop;

int main(int argc, char** argv) {
  CLI::App app{"trainloop zoo-model throughput (compare with benchmarks/zoo_vs_pytorch.py)"};
  std::string arch = "resnet18", mode_name = "single";
  int ranks = 2;
  int64_t size = 64, batch_size = 32, steps = 20, epochs = 2;
  app.add_option("--arch", arch, "a model of the zoo");
  app.add_option("--size", size, "image size in pixels");
  app.add_option("--batch-size", batch_size, "batch size (per rank in ddp)");
  app.add_option("--steps", steps, "optimizer steps per epoch");
  app.add_option("--epochs", epochs, "epochs; all but the last are warm-up");
  app.add_option("--mode", mode_name, "single or ddp");
  app.add_option("--ranks", ranks, "ddp: processes");
  std::string precision = "fp32", memory_format = "contiguous";
  app.add_option("--precision", precision, "fp32 or bf16 (autocast)")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--memory-format", memory_format, "contiguous or channels-last (as the Python side's flag)")
      ->check(CLI::IsMember({"contiguous", "channels-last"}));
  CLI11_PARSE(app, argc, argv);
  try {
    const int world = mode_name == "ddp" ? ranks : 1;
    const int64_t samples = world * batch_size * steps;
    auto x = torch::randn({samples, 3, size, size}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
    torch::manual_seed(0);
    tl::models::ImageClassifier net(arch, tl::models::ImageModelOptions().num_classes(10));
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    tl::gpu_mode::Any mode = tl::mode_from_flags(tl::ModeFlags{mode_name, "cpu", ranks, 2});
    tl::TrainLoop<tl::models::ImageClassifier, tl::gpu_mode::Any> loop(
        net, tl::data::TensorDataset(x, y, 10), {}, optimizer, torch::nn::CrossEntropyLoss(),
        tl::TrainLoopOptions().batch_size(batch_size).shuffle(false)
            .precision(tl::parse_precision(precision))
            .memory_format(tl::parse_memory_format(memory_format)),
        mode);
    auto history = loop.fit(epochs);
    for (const auto& e : history.epochs)
      std::printf("trainloop epoch %lld: steps %lld samples %lld seconds %.3f samples/s %.2f loss %.4f\n",
                  static_cast<long long>(e.epoch), static_cast<long long>(e.steps),
                  static_cast<long long>(e.samples), e.seconds, e.samples_per_second, e.train_loss);
    std::printf("RESULT trainloop samples_per_second %.3f\n", history.last().samples_per_second);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 1;
  }
}
