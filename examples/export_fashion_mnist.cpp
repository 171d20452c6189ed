// Writes Debian's Fashion-MNIST (the IDX files) out as an image folder of PNGs, so the image
// pipeline can be run on a real dataset that Debian ships:
//
//   export_fashion_mnist OUT_DIR     → OUT_DIR/{train,test}/<n>_<name>/<index>.png
//
// Class directories are numbered so that sorting them by name (as ImageFolder and torchvision
// do) gives Fashion-MNIST's label order.

#include <trainloop/trainloop.hpp>

#include <png.h>

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: export_fashion_mnist OUT_DIR\n";
    return 2;
  }
  const std::filesystem::path out = argv[1];
  const char* names[] = {"tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"};
  try {
    using trainloop::data::FashionMNIST;
    for (auto split : {FashionMNIST::Split::Train, FashionMNIST::Split::Test}) {
      FashionMNIST set(split, trainloop::data::FashionMNISTOptions().normalize(false));
      const auto pixels = set.inputs().mul(255.0).round().clamp(0, 255).to(torch::kUInt8).contiguous();
      const auto labels = set.targets();
      const std::filesystem::path dir = out / (split == FashionMNIST::Split::Train ? "train" : "test");
      for (int c = 0; c < 10; ++c) std::filesystem::create_directories(dir / (std::to_string(c) + "_" + names[c]));
      for (int64_t i = 0; i < pixels.size(0); ++i) {
        const int64_t label = labels[i].item<int64_t>();
        std::ostringstream name;
        name << std::setw(5) << std::setfill('0') << i << ".png";
        const auto path = dir / (std::to_string(label) + "_" + names[label]) / name.str();
        png_image image{};
        image.version = PNG_IMAGE_VERSION;
        image.width = 28;
        image.height = 28;
        image.format = PNG_FORMAT_GRAY;
        if (!png_image_write_to_file(&image, path.c_str(), 0, pixels[i].data_ptr<uint8_t>(), 0, nullptr)) {
          std::cerr << "cannot write " << path << ": " << image.message << '\n';
          return 1;
        }
      }
      std::cout << dir.string() << ": " << pixels.size(0) << " images\n";
    }
    return 0;
  } catch (const std::exception& e) {
    std::cerr << e.what() << '\n';
    return 1;
  }
}
