// An image folder (root/<class>/<image>) decoded and augmented in two loader threads.
#include <trainloop/trainloop.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>

namespace fs = std::filesystem;
namespace tl = trainloop;

// A 12 x 12 gray PGM image; .jpg/.jpeg/.png/.ppm/.pgm files are read alike.
void write_pgm(const fs::path& path, int brightness) {
  std::ofstream out(path, std::ios::binary);
  out << "P5\n12 12\n255\n";
  for (int i = 0; i < 144; ++i) out.put(static_cast<char>(brightness + i % 7 * 5));
}

int main() {
  const fs::path root = fs::temp_directory_path() / "trainloop-docs-images";
  fs::remove_all(root);
  fs::create_directories(root / "dark");
  fs::create_directories(root / "light");
  for (int i = 0; i < 32; ++i) {
    write_pgm(root / "dark" / (std::to_string(i) + ".pgm"), 20 + i);
    write_pgm(root / "light" / (std::to_string(i) + ".pgm"), 160 + i);
  }

  // Random steps draw from the sample's own stream (seed, epoch, index): the same augmentation
  // in every run, mode and loader thread.
  auto transforms = tl::data::Transforms()
                        .random_resized_crop(10, {0.6, 1.0})
                        .random_horizontal_flip()
                        .normalize({0.5}, {0.25})
                        .tensor_step([](torch::Tensor x, std::mt19937_64& generator) {  // a step of your own
                          return x + 0.05 * torch::randn(x.sizes(), tl::data::torch_generator(generator));
                        });
  tl::data::ImageFolder images(root, transforms);
  std::cout << images.size().value() << " images, classes:";
  for (const auto& name : images.classes()) std::cout << ' ' << name;
  std::cout << '\n';

  torch::manual_seed(0);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3)), torch::nn::ReLU(),
                            torch::nn::AdaptiveAvgPool2d(1), torch::nn::Flatten(), torch::nn::Linear(8, 2));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop loop(net, images, {}, optimizer, torch::nn::CrossEntropyLoss(),
                     tl::TrainLoopOptions().batch_size(16).num_workers(2).metrics({tl::Accuracy()}));
  const tl::History history = loop.fit(3);
  std::cout << "training accuracy after 3 epochs: " << history.train("accuracy") << '\n';
  fs::remove_all(root);
  return 0;
}
