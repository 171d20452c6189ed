// zoo_vs_pytorch (trainloop side): training throughput of a model of the zoo (resnet18,
// resnet50, ...) in single or ddp, to compare with Python PyTorch training torchvision's same
// model with the same loop (benchmarks/zoo_vs_pytorch.py; benchmarks/run_zoo_vs_pytorch.sh
// alternates them and reports medians).
//
//   zoo_vs_pytorch --arch resnet18 --size 64 --batch-size 32 --steps 20 --epochs 2 --mode single
//   zoo_vs_pytorch --exported resnet18.pt2 ...   # a torch.export program (timm's model, exported by
//                                                # examples/export_timm_model.py) instead of the zoo's:
//                                                # benchmarks/run_exported_vs_eager.sh
//
// The work, identical in both programs: synthetic in-memory images (N(0,1), 3 x size x size,
// 10 classes) of ranks * batch * steps samples, no shuffling, SGD(lr 0.01, momentum 0.9),
// cross-entropy, no validation and no metrics; --precision bf16 (autocast) and --memory-format
// channels-last as the Python side's same flags. single: 2 intra-op threads (trainloop's default on
// this 2-core machine); ddp: `--ranks` processes of 1 thread each over Gloo; --device cuda:0 trains on
// the GPU (GPU checklist item 6: resnet50 at 224 px, bf16, channels-last). Epoch 1 is a warm-up;
// the figure is the last epoch's samples/s (all ranks' samples over the epoch's training time).
//
// Output (from the launching process only): one line per epoch, then
//   RESULT trainloop samples_per_second <value>

#include <trainloop/interop.hpp>
#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

namespace tl = trainloop;

namespace {

struct Work {
  std::string mode_name = "single", precision = "fp32", memory_format = "contiguous", device = "cpu";
  int ranks = 2;
  int64_t size = 64, batch_size = 32, steps = 20, epochs = 2;
};

template <class Model>
void train(Model net, const Work& work) {
  const int world = work.mode_name == "ddp" ? work.ranks : 1;
  const int64_t samples = world * work.batch_size * work.steps;
  auto x = torch::randn({samples, 3, work.size, work.size}, at::detail::createCPUGenerator(1));
  auto y = torch::randint(0, 10, {samples}, at::detail::createCPUGenerator(2));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
  tl::gpu_mode::Any mode = tl::mode_from_flags(tl::ModeFlags{work.mode_name, work.device, work.ranks, 2});
  tl::TrainLoop<Model, tl::gpu_mode::Any> loop(
      net, tl::data::TensorDataset(x, y, 10), {}, optimizer, torch::nn::CrossEntropyLoss(),
      tl::TrainLoopOptions().batch_size(work.batch_size).shuffle(false)
          .precision(tl::parse_precision(work.precision))
          .memory_format(tl::parse_memory_format(work.memory_format)),
      mode);
  auto history = loop.fit(work.epochs);
  for (const auto& e : history.epochs)
    std::printf("trainloop epoch %lld: steps %lld samples %lld seconds %.3f samples/s %.2f loss %.4f\n",
                static_cast<long long>(e.epoch), static_cast<long long>(e.steps),
                static_cast<long long>(e.samples), e.seconds, e.samples_per_second, e.train_loss);
  std::printf("RESULT trainloop samples_per_second %.3f\n", history.last().samples_per_second);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainloop zoo-model throughput (compare with benchmarks/zoo_vs_pytorch.py)"};
  Work work;
  std::string arch = "resnet18", exported;
  app.add_option("--arch", arch, "a model of the zoo");
  app.add_option("--exported", exported, "a torch.export program (.pt2) to train instead of the zoo's model");
  app.add_option("--size", work.size, "image size in pixels");
  app.add_option("--batch-size", work.batch_size, "batch size (per rank in ddp)");
  app.add_option("--steps", work.steps, "optimizer steps per epoch");
  app.add_option("--epochs", work.epochs, "epochs; all but the last are warm-up");
  app.add_option("--mode", work.mode_name, "single or ddp");
  app.add_option("--ranks", work.ranks, "ddp: processes");
  app.add_option("--precision", work.precision, "fp32 or bf16 (autocast)")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--memory-format", work.memory_format, "contiguous or channels-last (as the Python side's flag)")
      ->check(CLI::IsMember({"contiguous", "channels-last"}));
  app.add_option("--device", work.device, "cpu, or cuda:0 (single: the batches are copied there each step, as the Python side's)");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::manual_seed(0);
    if (!exported.empty()) {
      train(tl::interop::ExportedProgram(exported), work);
    } else {
      train(tl::models::ImageClassifier(arch, tl::models::ImageModelOptions().num_classes(10)), work);
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << '\n';
    return 1;
  }
}
