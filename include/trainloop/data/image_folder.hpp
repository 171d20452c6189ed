#pragma once
/// @file
/// @brief ImageFolder: a dataset of image files laid out as root/\<class\>/\<image\>, as torchvision's.
///
/// @code
/// trainloop::data::ImageFolder train("data/train", trainloop::data::Transforms()
///     .random_resized_crop(224).random_horizontal_flip().normalize({0.485, 0.456, 0.406}, {0.229, 0.224, 0.225}));
/// loop.fit(10);   // decoding and augmentation run in the loader's workers (TrainLoopOptions::num_workers)
/// @endcode
///
/// - Classes are the sub-directories of `root`, sorted by name (index = position), as torchvision
///   sorts them; samples are every .jpg/.jpeg/.png/.ppm/.pgm file below a class directory, sorted by
///   path, so the sample order is the same on every machine. Other files are ignored and counted.
/// - Every image is decoded to the same number of channels: `channels(1 or 3)`, or by default the
///   channels of the first image (a grayscale image in an RGB set is converted, and the other way).
/// - Random transforms draw from (seed, epoch, sample index): the loop sets the epoch before each
///   epoch (set_epoch), so an augmentation is reproducible and identical in every mode.
/// - Errors name the path: a root that is missing or a file, no class directory, a class with no
///   image, an unreadable image (at the batch that reads it; with `skip_unreadable(true)` every
///   image is decoded once at construction and the unreadable ones are left out and counted).

#include <trainloop/data/image_decode.hpp>
#include <trainloop/data/transforms.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <torch/torch.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief Options of ImageFolder.
struct ImageFolderOptions {
  /// Channels of every decoded image: 1 (gray), 3 (RGB), or 0 for those of the first image.
  TORCH_ARG(int64_t, channels) = 0;
  /// Leave out (and count) images that cannot be decoded, found by decoding every image once at
  /// construction; false: an unreadable image is an error naming it when its batch is loaded.
  TORCH_ARG(bool, skip_unreadable) = false;
  /// Seed of the random transforms (combined with the epoch and the sample index).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// @brief A map-style dataset over root/\<class\>/\<image\> files; batches are stacked C x H x W
/// float images (every image must come out of the transforms at the same size) and int64 labels.
class ImageFolder : public torch::data::BatchDataset<ImageFolder, torch::data::Example<>, c10::ArrayRef<size_t>> {
 public:
  /// @brief Scans `root`. @throws trainloop::ConfigurationError naming the path (see the file comment).
  ImageFolder(std::filesystem::path root, Transforms transforms = {}, ImageFolderOptions options = {})
      : root_(std::move(root)), transforms_(std::move(transforms)), options_(std::move(options)),
        epoch_(std::make_shared<std::atomic<uint64_t>>(0)) {
    TRAINLOOP_CHECK(options_.channels() == 0 || options_.channels() == 1 || options_.channels() == 3,
                    "ImageFolder channels is ", options_.channels(), "; expected 0 (the first image's), 1 or 3");
    TRAINLOOP_CHECK(std::filesystem::exists(root_), "image folder ", root_.string(), " does not exist; expected a "
                    "directory with one sub-directory of images per class");
    TRAINLOOP_CHECK(std::filesystem::is_directory(root_), "image folder ", root_.string(), " is a file; expected a "
                    "directory with one sub-directory of images per class");
    for (const auto& entry : std::filesystem::directory_iterator(root_)) {
      if (entry.is_directory()) classes_.push_back(entry.path().filename().string());
    }
    std::sort(classes_.begin(), classes_.end());
    TRAINLOOP_CHECK(!classes_.empty(), "image folder ", root_.string(), " has no class directory; expected root/<class>/<image> files");
    for (size_t c = 0; c < classes_.size(); ++c) {
      class_to_index_[classes_[c]] = static_cast<int64_t>(c);
      std::vector<std::filesystem::path> files;
      for (const auto& entry : std::filesystem::recursive_directory_iterator(root_ / classes_[c])) {
        if (!entry.is_regular_file()) continue;
        if (is_image_extension(entry.path().extension().string())) {
          files.push_back(entry.path());
        } else {
          ++ignored_files_;
        }
      }
      TRAINLOOP_CHECK(!files.empty(), "class directory ", (root_ / classes_[c]).string(), " has no image (.jpg, "
                      ".jpeg, .png, .ppm, .pgm); expected at least one");
      std::sort(files.begin(), files.end());
      for (auto& file : files) samples_.push_back({std::move(file), static_cast<int64_t>(c)});
    }
    if (options_.skip_unreadable()) drop_unreadable();
    TRAINLOOP_CHECK(!samples_.empty(), "image folder ", root_.string(), " has no readable image");
    if (options_.channels() == 0) options_.channels(decode_image(samples_.front().path).channels);
  }

  /// @brief The class names, sorted; a label is the position of its class here.
  const std::vector<std::string>& classes() const { return classes_; }
  /// @brief Class name → label.
  const std::map<std::string, int64_t>& class_to_index() const { return class_to_index_; }
  /// @brief Files below class directories that are not images (ignored).
  int64_t ignored_files() const { return ignored_files_; }
  /// @brief Images left out as unreadable (skip_unreadable).
  const std::vector<std::filesystem::path>& skipped() const { return skipped_; }
  /// @brief The image file and label of sample `index`.
  const std::filesystem::path& path(size_t index) const { return samples_.at(index).path; }
  /// @brief The label of sample `index`.
  int64_t label(size_t index) const { return samples_.at(index).label; }
  /// @brief Channels every image is decoded to.
  int64_t channels() const { return options_.channels(); }

  /// @brief The epoch the random transforms draw for (the training loop sets it before each epoch).
  void set_epoch(uint64_t epoch) { epoch_->store(epoch); }

  /// @brief Sample `index`: decoded, transformed, labelled.
  torch::data::Example<> get(size_t index) const {
    TRAINLOOP_CHECK(index < samples_.size(), "sample index ", index, " is out of range; expected one below ", samples_.size());
    DecodeRequest request;
    request.channels = options_.channels();
    request.min_height = request.min_width = transforms_.min_size();
    auto generator = sample_generator(options_.seed(), epoch_->load(), index);
    auto image = transforms_.apply(decode_image(samples_[index].path, request), generator);
    return {image, torch::tensor(samples_[index].label, torch::kInt64)};
  }

  /// @brief The samples at `indices`, stacked.
  /// @throws trainloop::ConfigurationError when images come out in different sizes (add a resize).
  torch::data::Example<> get_batch(c10::ArrayRef<size_t> indices) override {
    std::vector<torch::Tensor> images, labels;
    images.reserve(indices.size());
    for (size_t index : indices) {
      auto example = get(index);
      if (!images.empty() && example.data.sizes() != images.front().sizes()) {
        throw ConfigurationError(::trainloop::detail::concat(
            "trainloop: image ", samples_[index].path.string(), " is ", example.data.sizes(), " after the transforms, ",
            samples_[indices[0]].path.string(), " is ", images.front().sizes(),
            "; expected one size for a batch (add resize / center_crop to the transforms)"));
      }
      images.push_back(std::move(example.data));
      labels.push_back(std::move(example.target));
    }
    return {torch::stack(images), torch::stack(labels)};
  }

  /// @brief The number of samples.
  c10::optional<size_t> size() const override { return samples_.size(); }

 private:
  struct Sample {
    std::filesystem::path path;
    int64_t label = 0;
  };

  void drop_unreadable() {
    std::vector<Sample> kept;
    for (auto& sample : samples_) {
      try {
        decode_image(sample.path, DecodeRequest{options_.channels(), 0, 0});
        kept.push_back(std::move(sample));
      } catch (const ConfigurationError&) {
        skipped_.push_back(sample.path);
      }
    }
    samples_ = std::move(kept);
  }

  std::filesystem::path root_;
  Transforms transforms_;
  ImageFolderOptions options_;
  std::vector<std::string> classes_;
  std::map<std::string, int64_t> class_to_index_;
  std::vector<Sample> samples_;
  std::vector<std::filesystem::path> skipped_;
  int64_t ignored_files_ = 0;
  std::shared_ptr<std::atomic<uint64_t>> epoch_;  // shared by copies (the loader's AnyDataset holds one)
};

}  // namespace trainloop::data
