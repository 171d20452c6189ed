// Writes Debian's Fashion-MNIST (the IDX files) out as an image folder of PNGs, so the image
// pipeline can be run on a real dataset that Debian ships:
//
//   export_fashion_mnist OUT_DIR [--size N] [--rgb]   → OUT_DIR/{train,test}/<n>_<name>/<index>.png
//
// --size N resizes the 28 x 28 images to N x N (bilinear, as torchvision's Resize); --rgb writes
// three equal channels, for models made for colour images (the zoo's, ImageNet's pretrained ones).
//
// Class directories are numbered so that sorting them by name (as ImageFolder and torchvision
// do) gives Fashion-MNIST's label order.

#include <trainloop/trainloop.hpp>

#include <png.h>

#include <filesystem>
#include <iomanip>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>
#include <cstdlib>

int main(int argc, char** argv) {
  const char* usage = "usage: export_fashion_mnist OUT_DIR [--size N] [--rgb]\n";
  if (argc < 2) {
    std::cerr << usage;
    return 2;
  }
  const std::filesystem::path out = argv[1];
  int64_t size = 28;
  bool rgb = false;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--rgb") {
      rgb = true;
    } else if (flag == "--size" && i + 1 < argc) {
      size = std::atoll(argv[++i]);
      if (size < 1 || size > 1024) {
        std::cerr << "--size is " << argv[i] << "; expected a number of pixels in [1, 1024]\n";
        return 2;
      }
    } else {
      std::cerr << "unknown argument '" << flag << "'; " << usage;
      return 2;
    }
  }
  const char* names[] = {"tshirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "boot"};
  try {
    using trainloop::data::FashionMNIST;
    for (auto split : {FashionMNIST::Split::Train, FashionMNIST::Split::Test}) {
      FashionMNIST set(split, trainloop::data::FashionMNISTOptions().normalize(false));
      auto images = set.inputs();  // N x 1 x 28 x 28 in [0, 1]
      if (size != 28) {
        images = torch::nn::functional::interpolate(
            images, torch::nn::functional::InterpolateFuncOptions().size(std::vector<int64_t>{size, size})
                        .mode(torch::kBilinear).align_corners(false));
      }
      if (rgb) images = images.expand({-1, 3, -1, -1});
      // PNG rows are pixel-interleaved: N x H x W x C.
      const auto pixels = images.mul(255.0).round().clamp(0, 255).to(torch::kUInt8).permute({0, 2, 3, 1}).contiguous();
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
        image.width = static_cast<png_uint_32>(size);
        image.height = static_cast<png_uint_32>(size);
        image.format = rgb ? PNG_FORMAT_RGB : PNG_FORMAT_GRAY;
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
