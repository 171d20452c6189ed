#pragma once
/// @file
/// @brief Image transforms composed like torchvision's: resize, center crop, random resized crop,
/// random horizontal flip, then to a float tensor (C x H x W in [0, 1]) and normalize.
///
/// @code
/// auto train = trainloop::data::Transforms().random_resized_crop(28).random_horizontal_flip()
///                  .normalize({0.2860}, {0.3530});
/// auto test  = trainloop::data::Transforms().resize(32).center_crop(28).normalize({0.2860}, {0.3530});
/// @endcode
///
/// Random steps draw from a generator seeded by (seed, epoch, sample index): the same sample gets
/// the same augmentation in every run and in every mode (DDP ranks, DataParallel replicas, loader
/// workers), whichever process or thread decodes it, and another one in the next epoch.
///
/// A user's own step joins the pipeline: `image_step` on the decoded image (in order with the
/// geometric steps), `tensor_step` on the final tensor. Either may take the sample's generator:
/// @code
/// auto train = trainloop::data::Transforms().resize(32)
///                  .image_step([](trainloop::data::Image image, std::mt19937_64& generator) { ... })
///                  .normalize({0.5}, {0.25})
///                  .tensor_step([](torch::Tensor x, std::mt19937_64& generator) {
///                    return x + 0.01 * torch::randn(x.sizes(), trainloop::data::torch_generator(generator));
///                  });
/// @endcode

#include <trainloop/data/image.hpp>
#include <trainloop/detail/stable_hash.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief The random stream of one sample in one epoch (SplitMix64 mixing of the three keys,
/// so neighbouring indices and epochs give unrelated streams).
inline std::mt19937_64 sample_generator(uint64_t seed, uint64_t epoch, uint64_t index) {
  using ::trainloop::detail::splitmix64;
  return std::mt19937_64(splitmix64(seed ^ splitmix64(epoch ^ splitmix64(index))));
}

/// @brief A uniform double in [0, 1) from 53 bits of the generator (the same on every platform,
/// unlike std::uniform_real_distribution).
inline double uniform01(std::mt19937_64& generator) { return static_cast<double>(generator() >> 11) * 0x1.0p-53; }

/// @brief A torch CPU generator seeded from the sample's stream, for a user step that draws with
/// torch's random functions (`torch::rand(sizes, torch_generator(generator))`). Torch's global
/// generator would not do: loader threads share it in no fixed order, so the draws would differ
/// from run to run.
inline at::Generator torch_generator(std::mt19937_64& generator) { return at::detail::createCPUGenerator(generator()); }

/// @brief A pipeline of image steps, then conversion to a tensor and normalization, then tensor steps.
class Transforms {
 public:
  /// One geometric step on the image, with the sample's generator.
  using Step = std::function<Image(Image, std::mt19937_64&)>;
  /// One step on the converted (and normalized) C x H x W float tensor, with the sample's generator.
  using TensorStep = std::function<torch::Tensor(torch::Tensor, std::mt19937_64&)>;

  /// @brief Resizes so the shorter side is `size` (torchvision's Resize(int)).
  Transforms& resize(int64_t size) {
    TRAINLOOP_CHECK(size > 0, "resize(", size, "); expected a positive size");
    steps_.push_back([size](Image image, std::mt19937_64&) {
      if (image.height <= image.width) {
        return data::resize(image, size, std::max<int64_t>(1, std::lround(static_cast<double>(size) * image.width / image.height)));
      }
      return data::resize(image, std::max<int64_t>(1, std::lround(static_cast<double>(size) * image.height / image.width)), size);
    });
    needs_size(size);
    return *this;
  }
  /// @brief Resizes to exactly height x width.
  Transforms& resize(int64_t height, int64_t width) {
    steps_.push_back([height, width](Image image, std::mt19937_64&) { return data::resize(image, height, width); });
    needs_size(std::max(height, width));
    return *this;
  }
  /// @brief The central `size` x `size` square (padded with zeros when the image is smaller).
  Transforms& center_crop(int64_t size) {
    TRAINLOOP_CHECK(size > 0, "center_crop(", size, "); expected a positive size");
    steps_.push_back([size](Image image, std::mt19937_64&) {
      if (image.height < size || image.width < size) image = pad_to(image, size);
      return crop(image, (image.height - size) / 2, (image.width - size) / 2, size, size);
    });
    needs_size(size);
    return *this;
  }
  /// @brief torchvision's RandomResizedCrop: a random area fraction in `scale` and aspect ratio in
  /// `ratio` (log-uniform), 10 tries, else a central crop; resized to `size` x `size`.
  Transforms& random_resized_crop(int64_t size, std::pair<double, double> scale = {0.08, 1.0},
                                  std::pair<double, double> ratio = {3.0 / 4.0, 4.0 / 3.0}) {
    TRAINLOOP_CHECK(size > 0 && scale.first > 0 && scale.first <= scale.second && ratio.first > 0 &&
                        ratio.first <= ratio.second,
                    "random_resized_crop(", size, ", scale [", scale.first, ", ", scale.second, "], ratio [", ratio.first,
                    ", ", ratio.second, "]); expected a positive size and ordered positive ranges");
    steps_.push_back([size, scale, ratio](Image image, std::mt19937_64& generator) {
      const double area = static_cast<double>(image.height * image.width);
      for (int attempt = 0; attempt < 10; ++attempt) {
        const double target = area * (scale.first + (scale.second - scale.first) * uniform01(generator));
        const double log_ratio = std::log(ratio.first) + (std::log(ratio.second) - std::log(ratio.first)) * uniform01(generator);
        const double aspect = std::exp(log_ratio);
        const auto width = static_cast<int64_t>(std::lround(std::sqrt(target * aspect)));
        const auto height = static_cast<int64_t>(std::lround(std::sqrt(target / aspect)));
        if (width > 0 && height > 0 && width <= image.width && height <= image.height) {
          const auto top = static_cast<int64_t>(uniform01(generator) * static_cast<double>(image.height - height + 1));
          const auto left = static_cast<int64_t>(uniform01(generator) * static_cast<double>(image.width - width + 1));
          return data::resize(crop(image, top, left, height, width), size, size);
        }
      }
      const int64_t side = std::min(image.height, image.width);
      return data::resize(crop(image, (image.height - side) / 2, (image.width - side) / 2, side, side), size, size);
    });
    needs_size(size);
    return *this;
  }
  /// @brief Mirrors the image left to right with probability `p`.
  Transforms& random_horizontal_flip(double p = 0.5) {
    TRAINLOOP_CHECK(p >= 0.0 && p <= 1.0, "random_horizontal_flip(", p, "); expected a probability in [0, 1]");
    steps_.push_back([p](Image image, std::mt19937_64& generator) {
      return uniform01(generator) < p ? flip_horizontal(std::move(image)) : image;
    });
    return *this;
  }
  /// @brief A step of the user's own on the image (H x W x C bytes), run in order with the steps
  /// above: `Image step(Image)`, or `Image step(Image, std::mt19937_64&)` for a random step.
  ///
  /// A random step draws only from the generator it is given (the sample's stream after the
  /// earlier steps' draws): then it too gives the same sample the same augmentation in every
  /// run, mode and loader thread. It sees the image at the size the earlier steps left: when a
  /// sized step (resize, crops) comes after it, images are decoded at full size, not scaled down.
  template <class F>
  Transforms& image_step(F step) {
    steps_.push_back(with_generator<Image>(std::move(step), "image_step"));
    user_image_step_ = true;
    return *this;
  }
  /// @brief A step of the user's own on the final C x H x W float tensor, after the conversion
  /// to [0, 1] and normalize() (as torchvision's RandomErasing after Normalize): `torch::Tensor
  /// step(torch::Tensor)` or `torch::Tensor step(torch::Tensor, std::mt19937_64&)`; tensor steps
  /// run in the order added, after every image step. Random draws as for image_step (for torch's
  /// random functions: torch_generator(generator)).
  template <class F>
  Transforms& tensor_step(F step) {
    tensor_steps_.push_back(with_generator<torch::Tensor>(std::move(step), "tensor_step"));
    return *this;
  }

  /// @brief After conversion to [0, 1]: (x - mean[c]) / std[c] per channel (one value: every channel).
  Transforms& normalize(std::vector<double> mean, std::vector<double> std) {
    TRAINLOOP_CHECK(!mean.empty() && mean.size() == std.size(), "normalize with ", mean.size(), " means and ", std.size(),
                    " standard deviations; expected as many of each, one per channel or one for all");
    for (double s : std) TRAINLOOP_CHECK(s > 0.0, "normalize std ", s, "; expected positive values");
    mean_ = std::move(mean);
    std_ = std::move(std);
    return *this;
  }

  /// @brief The smallest side the geometric steps need of the decoded image: a JPEG may be decoded
  /// down to it (0: full size; no step asked for a size, or a user's image_step comes before one).
  int64_t min_size() const { return full_size_ ? 0 : min_size_; }

  /// @brief Applies every image step with the sample's generator, converts to a C x H x W float
  /// tensor in [0, 1], normalized, then applies the tensor steps.
  torch::Tensor apply(Image image, std::mt19937_64& generator) const {
    for (const auto& step : steps_) image = step(std::move(image), generator);
    torch::Tensor tensor = to_tensor(image);
    for (const auto& step : tensor_steps_) tensor = step(std::move(tensor), generator);
    return tensor;
  }

 private:
  /// `step` as a Step or TensorStep: one that takes no generator gets one it ignores. Loader
  /// threads call one step at once, so it must be callable as const (no `mutable` lambda): a step
  /// with state of its own would race, and its results would depend on the threads' order.
  template <class Value, class F>
  static std::function<Value(Value, std::mt19937_64&)> with_generator(F step, const char* what) {
    constexpr bool takes_generator = std::is_invocable_r_v<Value, const F&, Value, std::mt19937_64&>;
    static_assert(takes_generator || std::is_invocable_r_v<Value, const F&, Value>,
                  "trainloop: a Transforms step must be callable on a const object as `T step(T)` or "
                  "`T step(T, std::mt19937_64&)`, with T = trainloop::data::Image for image_step and torch::Tensor "
                  "for tensor_step (loader threads call it at once: no `mutable` lambda)");
    if constexpr (std::is_constructible_v<bool, const F&>) {  // a std::function or a function pointer
      TRAINLOOP_CHECK(static_cast<bool>(step), "the step given to ", what, " is empty; expected a callable");
    }
    if constexpr (takes_generator) {
      return [step = std::move(step)](Value value, std::mt19937_64& generator) -> Value {
        return step(std::move(value), generator);
      };
    } else {
      return [step = std::move(step)](Value value, std::mt19937_64&) -> Value { return step(std::move(value)); };
    }
  }

  /// A geometric step needs `size` of the image it gets; a user's image step before it sees the
  /// decoded image, whose size only the user knows it needs, so decoding stays at full size.
  void needs_size(int64_t size) {
    min_size_ = std::max(min_size_, size);
    if (user_image_step_) full_size_ = true;
  }

  /// The image as a C x H x W float tensor in [0, 1], normalized.
  torch::Tensor to_tensor(const Image& image) const {
    const int64_t channels = image.channels, pixels = image.height * image.width;
    TRAINLOOP_CHECK(mean_.empty() || mean_.size() == 1 || static_cast<int64_t>(mean_.size()) == channels, "normalize has ",
                    mean_.size(), " means for an image of ", channels, " channels; expected 1 or ", channels);
    // One pass from H x W x C bytes to C x H x W floats, computing (value / 255 - mean) / std as
    // torchvision's ToTensor + Normalize do, to the same float. (Five tensor ops per image cost
    // a third of the pipeline.)
    auto tensor = torch::empty({channels, image.height, image.width}, torch::kFloat32);
    float* out = tensor.data_ptr<float>();
    const uint8_t* in = image.pixels.data();
    for (int64_t c = 0; c < channels; ++c) {
      const size_t k = mean_.size() == 1 ? 0 : static_cast<size_t>(c);
      const double mean = mean_.empty() ? 0.0 : mean_[k], std = mean_.empty() ? 1.0 : std_[k];
      const auto m = static_cast<float>(mean), s = static_cast<float>(std);
      float* plane = out + c * pixels;
      for (int64_t i = 0; i < pixels; ++i) plane[i] = (static_cast<float>(in[i * channels + c]) / 255.0f - m) / s;
    }
    return tensor;
  }

  /// `image` centred in a zero image of at least `size` x `size`.
  static Image pad_to(const Image& image, int64_t size) {
    Image out = Image::blank(std::max(image.height, size), std::max(image.width, size), image.channels);
    const int64_t top = (out.height - image.height) / 2, left = (out.width - image.width) / 2;
    for (int64_t y = 0; y < image.height; ++y) {
      std::copy(image.pixels.begin() + static_cast<std::ptrdiff_t>(y * image.width * image.channels),
                image.pixels.begin() + static_cast<std::ptrdiff_t>((y + 1) * image.width * image.channels),
                out.pixels.begin() + static_cast<std::ptrdiff_t>(((top + y) * out.width + left) * image.channels));
    }
    return out;
  }

  std::vector<Step> steps_;
  std::vector<TensorStep> tensor_steps_;
  std::vector<double> mean_, std_;
  int64_t min_size_ = 0;
  bool user_image_step_ = false;  // an image_step was added
  bool full_size_ = false;        // a sized step follows a user's image step: decode at full size
};

}  // namespace trainloop::data
