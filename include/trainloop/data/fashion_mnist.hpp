#pragma once
/// @file
/// @brief `trainloop::data::FashionMNIST`: Zalando's Fashion-MNIST from the gzip IDX files that
/// Debian's `dataset-fashion-mnist` package installs, as a TensorDataset.

#include <trainloop/data/idx_reader.hpp>
#include <trainloop/data/tensor_dataset.hpp>
#include <trainloop/error.hpp>

#include <torch/arg.h>
#include <torch/types.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <utility>

namespace trainloop::data {

/// @brief Options of FashionMNIST, fluent in the libtorch style:
/// `FashionMNISTOptions().root("/data/fmnist").normalize(false)`.
struct FashionMNISTOptions {
  /// @brief The directory the files are looked for in by default (see root).
  static std::filesystem::path default_root() {
    const char* from_environment = std::getenv("TRAINLOOP_FASHION_MNIST_DIR");
    return from_environment != nullptr && *from_environment != '\0' ? std::filesystem::path(from_environment)
                                                                      : std::filesystem::path("/usr/share/datasets/fashion-mnist");
  }

  /// Directory holding the four `*-idx?-ubyte.gz` files; Debian's package puts them here.
  /// Default: $TRAINLOOP_FASHION_MNIST_DIR when set (machines without Debian's package), else
  /// /usr/share/datasets/fashion-mnist.
  TORCH_ARG(std::filesystem::path, root) = default_root();
  /// When true, pixels (already scaled to [0,1]) are standardized with the training set's
  /// mean and std, so inputs are roughly zero-mean, unit-variance.
  TORCH_ARG(bool, normalize) = true;
};

/// @brief Fashion-MNIST: 60,000 training / 10,000 test grey 28x28 images of 10 clothing classes.
///
/// Inputs are float32 (N, 1, 28, 28): pixels / 255, then `(x - kMean) / kStd` unless
/// normalization is off. Targets are int64 (N) in [0, 10). Everything is loaded into memory at
/// construction (about 190 MB for the training split), so batches are a TensorDataset gather.
class FashionMNIST : public TensorDataset {
 public:
  /// Which half of the dataset.
  enum class Split { Train, Test };

  static constexpr double kMean = 0.2860;  ///< mean pixel of the training split, in [0,1] units
  static constexpr double kStd = 0.3530;   ///< pixel std of the training split, in [0,1] units
  static constexpr int64_t kNumClasses = 10;  ///< labels are in [0, 10)
  static constexpr int64_t kImageSize = 28;   ///< images are kImageSize x kImageSize

  /// @brief Loads `split` from `options.root()`.
  /// @throws trainloop::Error when a file is missing (naming the full path and the Debian
  ///         package that provides it), truncated or corrupt (naming the file and what was
  ///         expected), or the two files disagree.
  explicit FashionMNIST(Split split, const FashionMNISTOptions& options = {})
      : FashionMNIST(load(split, options), split) {}

  /// @brief Convenience: `FashionMNIST(split, directory)`.
  FashionMNIST(Split split, std::filesystem::path root, bool normalize = true)
      : FashionMNIST(split, FashionMNISTOptions().root(std::move(root)).normalize(normalize)) {}

  /// @brief The split this dataset holds.
  Split split() const noexcept { return split_; }

  /// @brief Path of the images file of `split` under `root`.
  static std::filesystem::path images_path(Split split, const std::filesystem::path& root) {
    return root / (split == Split::Train ? "train-images-idx3-ubyte.gz"
                                         : "t10k-images-idx3-ubyte.gz");
  }
  /// @brief Path of the labels file of `split` under `root`.
  static std::filesystem::path labels_path(Split split, const std::filesystem::path& root) {
    return root / (split == Split::Train ? "train-labels-idx1-ubyte.gz"
                                         : "t10k-labels-idx1-ubyte.gz");
  }

 private:
  FashionMNIST(std::pair<torch::Tensor, torch::Tensor> images_and_labels, Split split)
      : TensorDataset(std::move(images_and_labels.first), std::move(images_and_labels.second),
                      kNumClasses),
        split_(split) {}

  static void require_file(const std::filesystem::path& path) {
    TRAINLOOP_CHECK(std::filesystem::exists(path), "Fashion-MNIST file ", path.string(),
                    " does not exist; it is provided by the Debian package dataset-fashion-mnist "
                    "(apt-get install dataset-fashion-mnist), or set the directory that holds "
                    "the *-ubyte.gz files with FashionMNISTOptions().root(...)");
  }

  static std::pair<torch::Tensor, torch::Tensor> load(Split split,
                                                      const FashionMNISTOptions& options) {
    const auto images_file = images_path(split, options.root());
    const auto labels_file = labels_path(split, options.root());
    require_file(images_file);
    require_file(labels_file);

    const torch::Tensor raw_images = read_idx(images_file, kIdxImagesMagic);
    const torch::Tensor raw_labels = read_idx(labels_file, kIdxLabelsMagic);
    TRAINLOOP_CHECK(raw_images.size(1) == kImageSize && raw_images.size(2) == kImageSize,
                    images_file.string(), " holds ", raw_images.size(1), "x",
                    raw_images.size(2), " images; expected ", kImageSize, "x", kImageSize);
    TRAINLOOP_CHECK(raw_images.size(0) == raw_labels.size(0), images_file.string(), " holds ",
                    raw_images.size(0), " images but ", labels_file.string(), " holds ",
                    raw_labels.size(0), " labels; expected the same count");
    // Checked here, not only by TensorDataset, so the message names the file.
    const auto bad = raw_labels.ge(kNumClasses).nonzero();
    if (bad.size(0) > 0) {
      const int64_t at = bad[0][0].item<int64_t>();
      TRAINLOOP_CHECK(false, labels_file.string(), " has label ", raw_labels[at].item<int64_t>(),
                      " at index ", at, "; expected labels in [0, ", kNumClasses, ")");
    }

    auto images = raw_images.unsqueeze(1).to(torch::kFloat32).div_(255.0);
    if (options.normalize()) images.sub_(kMean).div_(kStd);
    return {std::move(images), raw_labels.to(torch::kInt64)};
  }

  Split split_;
};

}  // namespace trainloop::data
