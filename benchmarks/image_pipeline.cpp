// image_pipeline: images per second decoded, augmented and batched by ImageFolder through the
// loader's worker threads — what feeds a training step — without training. Alternated with
// torchvision's ImageFolder + DataLoader doing the same (benchmarks/run_image_pipeline.sh).
//
//   image_pipeline --make-folder DIR --images 2000        # synthetic 320x240 JPEG folder, 10 classes
//   image_pipeline --data DIR --workers 2 --size 224 --repetitions 1
//
// Per pass: RandomResizedCrop(size), RandomHorizontalFlip, ToTensor, Normalize on every image, in
// batches of --batch-size, shuffled; prints `RESULT trainloop workers <w> images_per_second <v>`.

#include "bench_common.hpp"

#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <jpeglib.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace data = trainloop::data;

/// Writes `count` 320 x 240 RGB JPEGs (quality 90) with smooth shapes and noise, in 10 classes.
void make_folder(const fs::path& root, int64_t count) {
  std::mt19937 random(1);
  std::vector<uint8_t> pixels(320 * 240 * 3);
  for (int64_t i = 0; i < count; ++i) {
    const fs::path dir = root / ("class" + std::to_string(i % 10));
    fs::create_directories(dir);
    const int fx = static_cast<int>(random() % 7 + 1), fy = static_cast<int>(random() % 5 + 1);
    for (int y = 0; y < 240; ++y)
      for (int x = 0; x < 320; ++x)
        for (int c = 0; c < 3; ++c)
          pixels[static_cast<size_t>((y * 320 + x) * 3 + c)] =
              static_cast<uint8_t>((128 + 100 * std::sin(fx * x * 0.02 + c) * std::cos(fy * y * 0.03)) + random() % 16);
    jpeg_compress_struct info{};
    jpeg_error_mgr errors{};
    info.err = jpeg_std_error(&errors);
    jpeg_create_compress(&info);
    const fs::path path = dir / (std::to_string(i) + ".jpg");
    FILE* file = std::fopen(path.c_str(), "wb");
    jpeg_stdio_dest(&info, file);
    info.image_width = 320;
    info.image_height = 240;
    info.input_components = 3;
    info.in_color_space = JCS_RGB;
    jpeg_set_defaults(&info);
    jpeg_set_quality(&info, 90, TRUE);
    jpeg_start_compress(&info, TRUE);
    while (info.next_scanline < info.image_height) {
      JSAMPROW row = pixels.data() + info.next_scanline * 320 * 3;
      jpeg_write_scanlines(&info, &row, 1);
    }
    jpeg_finish_compress(&info);
    jpeg_destroy_compress(&info);
    std::fclose(file);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ImageFolder decode + augment + batch throughput"};
  std::string make, data_dir;
  int64_t images = 2000, workers = 2, size = 224, batch_size = 64, repetitions = 1;
  app.add_option("--make-folder", make, "write a synthetic JPEG image folder here and exit");
  app.add_option("--images", images, "with --make-folder: how many images")->check(CLI::PositiveNumber);
  app.add_option("--data", data_dir, "the image folder to read");
  app.add_option("--workers", workers, "loader threads")->check(CLI::NonNegativeNumber);
  app.add_option("--size", size, "crop size")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "images per batch")->check(CLI::PositiveNumber);
  app.add_option("--repetitions", repetitions, "timed passes")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    if (!make.empty()) {
      make_folder(make, images);
      std::cout << "wrote " << images << " JPEGs into " << make << '\n';
      return 0;
    }
    // As in training: TrainLoop keeps freed memory (cpu/allocator.hpp) before its loaders start;
    // without it every decoded image and batch is faulted into fresh pages (half the time here).
    trainloop::cpu::keep_freed_memory();
    auto transforms = data::Transforms().random_resized_crop(size).random_horizontal_flip().normalize(
        {0.485, 0.456, 0.406}, {0.229, 0.224, 0.225});
    auto folder = std::make_shared<data::ImageFolder>(data_dir, transforms, data::ImageFolderOptions().channels(3));
    std::vector<double> rates;
    for (int64_t r = 0; r < repetitions; ++r) {
      folder->set_epoch(static_cast<uint64_t>(r));
      std::vector<size_t> order(*folder->size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::shuffle(order.begin(), order.end(), std::mt19937_64(static_cast<uint64_t>(r)));
      data::BatchLoader<data::ImageFolder> loader(folder, std::move(order), static_cast<size_t>(batch_size),
                                                  static_cast<size_t>(workers));
      int64_t seen = 0;
      const auto start = std::chrono::steady_clock::now();
      for (auto&& batch : loader) seen += batch.data.size(0);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      rates.push_back(static_cast<double>(seen) / seconds);
      std::printf("pass %lld: %lld images in %.2f s, %.1f images/s\n", static_cast<long long>(r + 1),
                  static_cast<long long>(seen), seconds, rates.back());
    }
    std::printf("RESULT trainloop workers %lld images_per_second %.1f\n", static_cast<long long>(workers), bench::median(rates));
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "image_pipeline: " << e.what() << '\n';
    return 1;
  }
}
