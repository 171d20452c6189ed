// Trains a small CNN on any image folder laid out as ROOT/train/<class>/<image> and
// ROOT/test/<class>/<image> (JPEG, PNG, PPM, PGM), as torchvision's ImageFolder reads them, and
// prints the test accuracy. Decoding and augmentation run in the loader's worker threads.
//
//   image_folder --data ROOT --epochs 4 [--size 28] [--augment] [--workers 2] [--gpu-mode ddp]
//   scripts/export-fashion-mnist-images.sh /tmp/fmnist-png && image_folder --data /tmp/fmnist-png

#include "image_cnn.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <iostream>

int main(int argc, char** argv) {
  CLI::App app{"Train a CNN on an image folder with trainloop"};
  std::string data_dir, gpu_mode = "single", device = "cpu", plot_png, tensorboard_dir;
  std::string precision = "fp32", memory_format = "auto";
  int64_t epochs = 4, batch_size = 64, workers = 2, size = 0, channels = 0;
  uint64_t seed = 0;
  double learning_rate = 1e-3;
  bool augment = false;
  std::vector<double> mean, stddev;
  int procs = 0, replicas = 2;
  app.add_option("--data", data_dir, "ROOT holding train/<class>/<image> and test/<class>/<image>")->required();
  app.add_option("--epochs", epochs, "training epochs")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "samples per batch (per rank in ddp)")->check(CLI::PositiveNumber);
  app.add_option("--workers", workers, "loader threads decoding and augmenting images")->check(CLI::NonNegativeNumber);
  app.add_option("--size", size, "resize the shorter side to N and center-crop N x N (0: keep the images' size)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--channels", channels, "1 (gray) or 3 (RGB); 0: the first image's")->check(CLI::IsMember({0, 1, 3}));
  app.add_flag("--augment", augment, "random resized crops and horizontal flips for training (needs --size)");
  app.add_option("--mean", mean, "per-channel means to normalize with (default: measured on 1000 training images)");
  app.add_option("--std", stddev, "per-channel standard deviations to normalize with");
  app.add_option("--gpu-mode", gpu_mode, "single, dp, ddp or fsdp");
  app.add_option("--device", device, "cpu or cuda:N");
  app.add_option("--procs", procs, "ddp: processes on this machine");
  app.add_option("--replicas", replicas, "dp on the CPU: number of model replicas");
  app.add_option("--lr", learning_rate, "Adam learning rate");
  app.add_option("--precision", precision, "fp32, bf16 (autocast, CPU or CUDA) or fp16 (autocast + loss scaling, CUDA)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  app.add_option("--memory-format", memory_format,
                 "auto (channels-last for convolutional models), contiguous or channels-last")
      ->check(CLI::IsMember({"auto", "contiguous", "channels-last"}));
  app.add_option("--seed", seed, "seed for weights, shuffling and augmentation");
  app.add_option("--plot", plot_png, "draw the training curves into this PNG (and an SVG)");
  app.add_option("--tensorboard", tensorboard_dir, "write TensorBoard scalars into this directory");
  CLI11_PARSE(app, argc, argv);

  try {
    namespace data = trainloop::data;
    TRAINLOOP_CHECK(!augment || size > 0, "--augment needs --size N (the crop size); got --size 0");
    auto options = data::ImageFolderOptions().channels(channels).seed(seed);
    if (mean.empty()) {
      // Per-channel statistics of up to 1000 training images, spread over the whole set.
      data::ImageFolder raw(std::filesystem::path(data_dir) / "train", size > 0 ? data::Transforms().resize(size).center_crop(size)
                                                                                : data::Transforms(), options);
      const size_t n = *raw.size(), take = std::min<size_t>(n, 1000);
      std::vector<size_t> picks;
      for (size_t i = 0; i < take; ++i) picks.push_back(i * n / take);
      const auto images = raw.get_batch(picks).data;
      const auto per_channel = images.transpose(0, 1).flatten(1);
      for (int64_t c = 0; c < per_channel.size(0); ++c) {
        mean.push_back(per_channel[c].mean().item<double>());
        stddev.push_back(per_channel[c].std().item<double>());
      }
    }
    data::Transforms train_transforms, test_transforms;
    if (size > 0) test_transforms.resize(size).center_crop(size);
    if (augment) {
      train_transforms.random_resized_crop(size, {0.6, 1.0}).random_horizontal_flip();
    } else if (size > 0) {
      train_transforms.resize(size).center_crop(size);
    }
    train_transforms.normalize(mean, stddev);
    test_transforms.normalize(mean, stddev);
    data::ImageFolder train(std::filesystem::path(data_dir) / "train", train_transforms, options);
    data::ImageFolder test(std::filesystem::path(data_dir) / "test", test_transforms, options.channels(train.channels()));
    TRAINLOOP_CHECK(train.classes() == test.classes(), "train/ has ", train.classes().size(), " classes and test/ ",
                    test.classes().size(), "; expected the same class directories in both");
    if (trainloop::is_main_process()) {
      std::cout << "image folder " << data_dir << ": " << *train.size() << " training and " << *test.size()
                << " test images, " << train.classes().size() << " classes, " << train.channels() << " channel(s)"
                << (train.ignored_files() > 0 ? ", " + std::to_string(train.ignored_files()) + " other files ignored" : "")
                << '\n';
    }

    trainloop::gpu_mode::Any mode = trainloop::mode_from_flags(
        trainloop::ModeFlags{.gpu_mode = gpu_mode, .device = device, .procs = procs, .replicas = replicas, .extra = {}});
    torch::manual_seed(seed);
    ImageCnn net(train.channels(), static_cast<int64_t>(train.classes().size()));
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(learning_rate));
    trainloop::TrainLoop loop(  // TrainLoop<ImageCnn, gpu_mode::Any>, from `net` and `mode`
        net, train, test, optimizer, torch::nn::CrossEntropyLoss(),
        trainloop::TrainLoopOptions()
            .batch_size(batch_size)
            .num_workers(workers)
            .seed(seed)
            .precision(trainloop::parse_precision(precision))
            .memory_format(trainloop::parse_memory_format(memory_format))
            .metrics({trainloop::Accuracy()}),
        mode);
    trainloop::CallbackList callbacks{std::make_shared<trainloop::ProgressBar>()};
    if (!plot_png.empty()) callbacks.push_back(std::make_shared<trainloop::TrainingPlot>(plot_png));
    if (!tensorboard_dir.empty()) callbacks.push_back(std::make_shared<trainloop::TensorBoardLogger>(tensorboard_dir));
    auto history = loop.fit(epochs, callbacks);
    double seconds = 0;
    for (const auto& epoch : history.epochs) seconds += epoch.seconds;
    std::cout << mode.name() << ": test accuracy " << history.validation("accuracy") << " (loss "
              << history.validation_loss() << ", " << history.last().validation->samples << " test images) after "
              << history.epochs.size() << " epochs, " << seconds << " s of training\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
