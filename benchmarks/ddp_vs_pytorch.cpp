// ddp_vs_pytorch (trainloop side): throughput of gpu_mode::DistributedDataParallel on CPU ranks,
// to compare with PyTorch's Python DDP doing the same work (benchmarks/ddp_vs_pytorch.py; both
// are alternated by benchmarks/run_ddp_vs_pytorch.sh, which reports the median ratio).
//
//   ddp_vs_pytorch --ranks 2 --batch-size 64 --steps 150 --epochs 2
//
// The work, identical in both programs:
// - a wide MLP 784 -> 1024 -> 1024 -> 10 (ReLU), ~1.86 M parameters (7.5 MB of gradients per
//   step), so the all-reduce is a real share of the step;
// - synthetic in-memory data: ranks * batch * steps samples of N(0,1) features and 10 classes,
//   no shuffling, per-rank batch `--batch-size`, SGD(lr 0.01, momentum 0.9), cross-entropy;
// - one intra-op thread per rank (trainloop divides the cores itself: 2 cores / 2 ranks);
// - no validation set and no metrics.
// Epoch 1 is a warm-up (allocator, Gloo connections); the figure is the last epoch's
// History::samples_per_second (samples over all ranks / wall time of the training part of the
// epoch), which is what the Python script measures around its own training loop.
//
// Output (from the launching process only, after fit() returns): one line per epoch, then
//   RESULT trainloop samples_per_second <value>

#include "bench_common.hpp"

#include <trainloop/gpu_mode/distributed_data_parallel.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

namespace tl = trainloop;

using bench::WideMlp;  // the same network as benchmarks/ddp_vs_pytorch.py

int main(int argc, char** argv) {
  CLI::App app{"trainloop DDP throughput (compare with benchmarks/ddp_vs_pytorch.py)"};
  int ranks = 2;
  int64_t batch_size = 64, steps = 150, epochs = 2;
  app.add_option("--ranks", ranks, "CPU ranks");
  app.add_option("--batch-size", batch_size, "per-rank batch size");
  app.add_option("--steps", steps, "optimizer steps per epoch");
  app.add_option("--epochs", epochs, "epochs; all but the last are warm-up");
  CLI11_PARSE(app, argc, argv);
  try {
    // Every rank re-runs this program from the top: same seeds, same data in every process.
    torch::manual_seed(0);
    const int64_t samples = static_cast<int64_t>(ranks) * batch_size * steps;
    auto x = torch::randn({samples, 784}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
    tl::data::TensorDataset train(x, y, 10);
    WideMlp net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto mode = tl::gpu_mode::DistributedDataParallel().procs_per_node(ranks).device_type(torch::kCPU);
    auto options = tl::TrainLoopOptions().batch_size(batch_size).shuffle(false)
                       .memory_format(tl::MemoryFormat::contiguous);  // as the Python side trains
    tl::TrainLoop<WideMlp, tl::gpu_mode::DistributedDataParallel> loop(net, train, {}, optimizer,
                                                                       torch::nn::CrossEntropyLoss(), options, mode);
    auto history = loop.fit(epochs);
    for (const auto& e : history.epochs)
      std::printf("trainloop epoch %lld: steps %lld samples %lld seconds %.4f samples/s %.1f loss %.4f\n",
                  static_cast<long long>(e.epoch), static_cast<long long>(e.steps),
                  static_cast<long long>(e.samples), e.seconds, e.samples_per_second, e.train_loss);
    std::printf("RESULT trainloop samples_per_second %.3f\n", history.last().samples_per_second);
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 1;
  }
}
