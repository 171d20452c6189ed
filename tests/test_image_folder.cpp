#define BOOST_TEST_MODULE test_image_folder
#include "unit_test.hpp"

// ImageFolder on small folders of real JPEG, PNG and PGM files, written here with the same
// libraries (libjpeg-turbo, libpng) that decode them.

#include "test_support.hpp"

#include <trainloop/trainloop.hpp>

#include <jpeglib.h>
#include <png.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;
using tl::data::Image;

namespace {


/// A deterministic test picture: a gradient, different per `salt`.
Image picture(int64_t height, int64_t width, int64_t channels, int salt) {
  Image image = Image::blank(height, width, channels);
  for (int64_t y = 0; y < height; ++y)
    for (int64_t x = 0; x < width; ++x)
      for (int64_t c = 0; c < channels; ++c)
        image.pixels[static_cast<size_t>((y * width + x) * channels + c)] =
            static_cast<uint8_t>((x * 3 + y * 3 + c * 30 + salt * 2) % 256);  // smooth at 20 x 24: JPEG keeps it close
  return image;
}

void write_png(const fs::path& path, const Image& image) {
  png_image info{};
  info.version = PNG_IMAGE_VERSION;
  info.width = static_cast<png_uint_32>(image.width);
  info.height = static_cast<png_uint_32>(image.height);
  info.format = image.channels == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;
  BOOST_REQUIRE(png_image_write_to_file(&info, path.c_str(), 0, image.pixels.data(), 0, nullptr));
}

void write_jpeg(const fs::path& path, const Image& image, int quality = 95) {
  jpeg_compress_struct info{};
  jpeg_error_mgr errors{};
  info.err = jpeg_std_error(&errors);
  jpeg_create_compress(&info);
  FILE* file = std::fopen(path.c_str(), "wb");
  BOOST_REQUIRE(file != nullptr);
  jpeg_stdio_dest(&info, file);
  info.image_width = static_cast<JDIMENSION>(image.width);
  info.image_height = static_cast<JDIMENSION>(image.height);
  info.input_components = static_cast<int>(image.channels);
  info.in_color_space = image.channels == 1 ? JCS_GRAYSCALE : JCS_RGB;
  jpeg_set_defaults(&info);
  jpeg_set_quality(&info, quality, TRUE);
  jpeg_start_compress(&info, TRUE);
  while (info.next_scanline < info.image_height) {
    JSAMPROW row = const_cast<uint8_t*>(image.pixels.data()) + info.next_scanline * image.width * image.channels;
    jpeg_write_scanlines(&info, &row, 1);
  }
  jpeg_finish_compress(&info);
  jpeg_destroy_compress(&info);
  std::fclose(file);
}

void write_pgm(const fs::path& path, const Image& image) {
  std::ofstream out(path, std::ios::binary);
  out << "P5\n# a comment\n" << image.width << ' ' << image.height << "\n255\n";
  out.write(reinterpret_cast<const char*>(image.pixels.data()), static_cast<std::streamsize>(image.pixels.size()));
}

/// root/cat: 3 PNGs; root/dog: 2 JPEGs and a PGM (gray), and a text file; root/zebra: 1 PNG.
fs::path make_folder(const fs::path& root) {
  fs::create_directories(root / "cat");
  fs::create_directories(root / "dog");
  fs::create_directories(root / "zebra");
  for (int i = 0; i < 3; ++i) write_png(root / "cat" / ("c" + std::to_string(i) + ".png"), picture(20, 24, 3, i));
  write_jpeg(root / "dog" / "d0.jpg", picture(20, 24, 3, 10));
  write_jpeg(root / "dog" / "d1.JPEG", picture(20, 24, 3, 11));
  write_pgm(root / "dog" / "d2.pgm", picture(20, 24, 1, 12));
  std::ofstream(root / "dog" / "notes.txt") << "not an image";
  write_png(root / "zebra" / "z0.png", picture(20, 24, 3, 20));
  return root;
}

}  // namespace

BOOST_AUTO_TEST_CASE(classes_are_sorted_samples_ordered_and_other_files_counted) {
  TempDir dir;
  tl::data::ImageFolder folder(make_folder(dir.path));
  BOOST_TEST((folder.classes() == std::vector<std::string>{"cat", "dog", "zebra"}));
  BOOST_TEST(folder.class_to_index().at("zebra") == 2);
  BOOST_TEST(*folder.size() == 7u);
  BOOST_TEST(folder.ignored_files() == 1);
  BOOST_TEST(folder.path(3).filename() == "d0.jpg");  // cat's three, then dog's in name order
  BOOST_TEST(folder.label(6) == 2);
  BOOST_TEST(folder.channels() == 3);  // the first image's
}

BOOST_AUTO_TEST_CASE(png_and_pgm_decode_exactly_and_jpeg_closely_with_gray_converted) {
  TempDir dir;
  tl::data::ImageFolder folder(make_folder(dir.path));
  // PNG: lossless; to tensor in [0, 1], C x H x W.
  auto cat = folder.get(1).data;
  auto expected = torch::from_blob(picture(20, 24, 3, 1).pixels.data(), {20, 24, 3}, torch::kUInt8)
                      .permute({2, 0, 1}).to(torch::kFloat32).div(255.0);
  BOOST_TEST(torch::equal(cat, expected));
  // JPEG at quality 95: within a few grey levels on average.
  auto dog = folder.get(3).data;
  auto original = torch::from_blob(picture(20, 24, 3, 10).pixels.data(), {20, 24, 3}, torch::kUInt8)
                      .permute({2, 0, 1}).to(torch::kFloat32).div(255.0);
  BOOST_TEST((dog - original).abs().mean().item<double>() < 4.0 / 255);
  // A gray PGM in an RGB set comes out RGB, each channel the gray value.
  auto gray = folder.get(5).data;
  BOOST_TEST(gray.size(0) == 3);
  BOOST_TEST(torch::equal(gray[0], gray[2]));
  // The whole folder as one batch.
  auto batch = folder.get_batch({0, 3, 5, 6});
  BOOST_TEST((batch.data.sizes() == torch::IntArrayRef{4, 3, 20, 24}));
  BOOST_TEST((batch.target.equal(torch::tensor({0, 1, 1, 2}, torch::kInt64))));
}

BOOST_AUTO_TEST_CASE(jpeg_scaled_decoding_decodes_only_what_the_transforms_need) {
  TempDir dir;
  write_jpeg(dir.path / "big.jpg", picture(400, 640, 3, 1));
  auto full = tl::data::decode_image(dir.path / "big.jpg");
  BOOST_TEST(full.height == 400);
  auto small = tl::data::decode_image(dir.path / "big.jpg", tl::data::DecodeRequest{3, 90, 90});
  BOOST_TEST(small.height == 100);  // 1/4: the smallest scale still >= 90 on both sides
  BOOST_TEST(small.width == 160);
  auto gray = tl::data::decode_image(dir.path / "big.jpg", tl::data::DecodeRequest{1, 0, 0});
  BOOST_TEST(gray.channels == 1);
}

BOOST_AUTO_TEST_CASE(transforms_are_reproducible_per_seed_epoch_and_sample) {
  TempDir dir;
  make_folder(dir.path);
  auto transforms = tl::data::Transforms().random_resized_crop(16).random_horizontal_flip().normalize({0.5}, {0.25});
  tl::data::ImageFolder a(dir.path, transforms, tl::data::ImageFolderOptions().seed(7));
  tl::data::ImageFolder b(dir.path, transforms, tl::data::ImageFolderOptions().seed(7));
  BOOST_TEST((a.get(2).data.sizes() == torch::IntArrayRef{3, 16, 16}));
  BOOST_TEST(torch::equal(a.get(2).data, b.get(2).data));  // same seed, epoch, sample: same pixels
  BOOST_TEST(torch::equal(a.get(2).data, a.get(2).data));  // whichever thread asks, whenever
  auto epoch0 = a.get(2).data;
  a.set_epoch(1);
  BOOST_TEST(!torch::equal(a.get(2).data, epoch0));  // another epoch, another augmentation
  tl::data::ImageFolder other_seed(dir.path, transforms, tl::data::ImageFolderOptions().seed(8));
  BOOST_TEST(!torch::equal(other_seed.get(2).data, epoch0));
}

BOOST_AUTO_TEST_CASE(resize_crop_and_flip_do_what_torchvision_does) {
  Image image = picture(4, 6, 1, 0);
  auto flipped = tl::data::flip_horizontal(image);
  BOOST_TEST(flipped.at(1, 0, 0) == image.at(1, 5, 0));
  auto cropped = tl::data::crop(image, 1, 2, 2, 3);
  BOOST_TEST(cropped.at(0, 0, 0) == image.at(1, 2, 0));
  // Bilinear with half-pixel centres: halving a 2-pixel-periodic image averages neighbours.
  Image stripes = Image::blank(2, 4, 1);
  stripes.pixels = {0, 100, 0, 100, 0, 100, 0, 100};
  auto half = tl::data::resize(stripes, 1, 2);
  BOOST_TEST(half.at(0, 0, 0) == 50);
  auto center = tl::data::Transforms().resize(8).center_crop(6);
  std::mt19937_64 generator(0);
  BOOST_TEST((center.apply(picture(16, 32, 3, 0), generator).sizes() == torch::IntArrayRef{3, 6, 6}));
}

BOOST_AUTO_TEST_CASE(a_user_step_runs_in_order_and_draws_from_the_sample_stream) {
  const Image image = picture(16, 32, 3, 0);
  auto invert = [](Image in) {
    for (auto& p : in.pixels) p = static_cast<uint8_t>(255 - p);
    return in;
  };
  // An image step without a generator runs where it was added: after resize, before the crop.
  std::vector<int64_t> seen_heights;
  auto seen = &seen_heights;
  auto inverted = tl::data::Transforms().resize(8).image_step([&invert, seen](Image in) {
    seen->push_back(in.height);
    return invert(std::move(in));
  }).center_crop(6);
  std::mt19937_64 generator(0), unused(0);
  auto resized_then_inverted = tl::data::Transforms().resize(8).image_step(invert).center_crop(6);
  BOOST_TEST(torch::equal(inverted.apply(image, generator), resized_then_inverted.apply(image, unused)));
  BOOST_TEST(seen_heights == std::vector<int64_t>{8}, boost::test_tools::per_element());
  // A tensor step runs on the final tensor, after normalize, whenever it was added.
  auto doubled = tl::data::Transforms().tensor_step([](torch::Tensor x) { return x * 2; }).normalize({0.5}, {0.25});
  auto plain = tl::data::Transforms().normalize({0.5}, {0.25});
  BOOST_TEST(torch::equal(doubled.apply(image, generator), plain.apply(image, generator) * 2));

  // Random user steps draw from the sample's generator, after the built-in steps' draws: those
  // keep their augmentation, and the user's is reproducible per seed, epoch and sample.
  auto builtin = tl::data::Transforms().random_resized_crop(16).random_horizontal_flip();
  auto with_user_steps = tl::data::Transforms()
                             .random_resized_crop(16)
                             .random_horizontal_flip()
                             .image_step([](Image in, std::mt19937_64& g) {
                               const auto shift = static_cast<uint8_t>(g() % 40);
                               for (auto& p : in.pixels) p = static_cast<uint8_t>(std::min(255, p + shift));
                               return in;
                             })
                             .tensor_step([](torch::Tensor x, std::mt19937_64& g) {
                               return x + 0.01 * torch::randn(x.sizes(), tl::data::torch_generator(g));
                             });
  for (uint64_t epoch : {0, 1}) {
    auto g1 = tl::data::sample_generator(7, epoch, 2), g2 = g1, g3 = g1;
    const auto base = builtin.apply(image, g1);
    const auto augmented = with_user_steps.apply(image, g2);
    BOOST_TEST(torch::equal(augmented, with_user_steps.apply(image, g3)));  // same stream, same pixels
    BOOST_TEST(!torch::equal(augmented, base));
    BOOST_TEST((augmented - base).abs().max().item<double>() < 40.0 / 255.0 + 0.1);  // shift + noise on the same crop
  }

  // Through ImageFolder, whichever thread decodes a sample, in any order: the same tensor.
  TempDir dir;
  make_folder(dir.path);
  tl::data::ImageFolder folder(dir.path, with_user_steps, tl::data::ImageFolderOptions().seed(7));
  std::vector<torch::Tensor> serial, threaded(folder.size().value());
  for (size_t i = 0; i < threaded.size(); ++i) serial.push_back(folder.get(i).data);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < 3; ++t) {  // every third sample each, last first
    threads.emplace_back([&, t] {
      for (size_t i = threaded.size() - 1 - t; i < threaded.size(); i -= 3) threaded[i] = folder.get(i).data;
    });
  }
  for (auto& thread : threads) thread.join();
  for (size_t i = 0; i < serial.size(); ++i) BOOST_TEST(torch::equal(serial[i], threaded[i]), "sample " << i);
  folder.set_epoch(1);
  BOOST_TEST(!torch::equal(folder.get(0).data, serial[0]));  // another epoch, another augmentation

  // A user image step before a sized step sees the decoded image at full size.
  BOOST_TEST(tl::data::Transforms().resize(28).image_step(invert).min_size() == 28);
  BOOST_TEST(tl::data::Transforms().image_step(invert).resize(28).min_size() == 0);
  BOOST_CHECK_THROW(tl::data::Transforms().image_step(std::function<Image(Image)>()), tl::ConfigurationError);
}

BOOST_AUTO_TEST_CASE(bad_folders_and_images_are_errors_that_name_the_path) {
  TempDir dir;
  auto message = error_of([&] { tl::data::ImageFolder(dir.path / "missing"); });
  BOOST_TEST(message.find((dir.path / "missing").string() + " does not exist") != std::string::npos, message);
  std::ofstream(dir.path / "file") << "x";
  message = error_of([&] { tl::data::ImageFolder(dir.path / "file"); });
  BOOST_TEST(message.find("is a file") != std::string::npos, message);
  fs::create_directories(dir.path / "empty");
  message = error_of([&] { tl::data::ImageFolder(dir.path / "empty"); });
  BOOST_TEST(message.find("has no class directory") != std::string::npos, message);
  fs::create_directories(dir.path / "root" / "a");
  std::ofstream(dir.path / "root" / "a" / "readme.md") << "x";
  message = error_of([&] { tl::data::ImageFolder(dir.path / "root"); });
  BOOST_TEST(message.find((dir.path / "root" / "a").string() + " has no image") != std::string::npos, message);

  // A truncated JPEG and a corrupt PNG: named at the batch that reads them, or skipped and counted.
  const auto set = make_folder(dir.path / "set");
  write_jpeg(set / "dog" / "d3.jpg", picture(64, 64, 3, 3));
  fs::resize_file(set / "dog" / "d3.jpg", fs::file_size(set / "dog" / "d3.jpg") / 2);
  std::ofstream(set / "cat" / "c9.png", std::ios::binary) << "\x89PNG\r\n\x1a\n garbage";
  tl::data::ImageFolder strict(set);
  BOOST_TEST(*strict.size() == 9u);
  message = error_of([&] { strict.get_batch({0, 1, 2, 3}); });  // c9.png is sample 3
  BOOST_TEST(message.find((set / "cat" / "c9.png").string()) != std::string::npos, message);
  message = error_of([&] { strict.get(7); });  // d3.jpg
  BOOST_TEST(message.find((set / "dog" / "d3.jpg").string() + ": it ends early (truncated)") != std::string::npos, message);
  tl::data::ImageFolder lenient(set, {}, tl::data::ImageFolderOptions().skip_unreadable(true));
  BOOST_TEST(*lenient.size() == 7u);
  BOOST_TEST(lenient.skipped().size() == 2u);
  BOOST_TEST(lenient.get_batch({0, 1, 2, 3, 4, 5, 6}).data.size(0) == 7);
}

struct BrightnessNetImpl : torch::nn::Module {
  BrightnessNetImpl() : fc(register_module("fc", torch::nn::Linear(64, 2))) {}
  torch::Tensor forward(torch::Tensor x) { return fc(x.flatten(1)); }
  torch::nn::Linear fc;
};
TORCH_MODULE(BrightnessNet);

BOOST_AUTO_TEST_CASE(a_train_loop_learns_from_an_image_folder_with_workers) {
  // Two classes told apart by brightness, 32 images each, decoded in 2 loader workers.
  TempDir dir;
  for (int c = 0; c < 2; ++c) {
    fs::create_directories(dir.path / std::to_string(c));
    for (int i = 0; i < 32; ++i) {
      Image image = Image::blank(8, 8, 1);
      for (auto& p : image.pixels) p = static_cast<uint8_t>(c == 0 ? 40 + i : 180 + i);
      write_png(dir.path / std::to_string(c) / (std::to_string(i) + ".png"), image);
    }
  }
  tl::data::ImageFolder folder(dir.path, tl::data::Transforms().normalize({0.5}, {0.25}));
  torch::manual_seed(0);
  BrightnessNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<BrightnessNet> loop(net, folder, folder, optimizer, torch::nn::CrossEntropyLoss(),
                                            tl::TrainLoopOptions().batch_size(8).num_workers(2).metrics(
                                                {std::make_shared<tl::Accuracy>()}));
  auto history = loop.fit(5);
  BOOST_TEST(history.last().validation->metrics.at("accuracy") == 1.0);
}
