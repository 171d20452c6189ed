#pragma once
/// @file
/// @brief An 8-bit image in memory (height x width x channels, row-major) and the geometric
/// operations the transforms need: bilinear resize, crop, horizontal flip, channel conversion.
/// Hand-written: these are a few loops, and no Debian package offers them without a large
/// dependency (OpenCV); they follow torchvision's definitions (half-pixel centres for resize).

#include <trainloop/error.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace trainloop::data {

/// @brief Pixels as decoded: `height` rows of `width` pixels of `channels` bytes (1 gray, 3 RGB).
struct Image {
  int64_t height = 0;             ///< rows
  int64_t width = 0;              ///< pixels per row
  int64_t channels = 0;           ///< bytes per pixel: 1 (gray) or 3 (RGB)
  std::vector<uint8_t> pixels;    ///< height * width * channels bytes

  /// @brief An image of the given size, zero-filled.
  static Image blank(int64_t height, int64_t width, int64_t channels) {
    Image image;
    image.height = height;
    image.width = width;
    image.channels = channels;
    image.pixels.assign(static_cast<size_t>(height * width * channels), 0);
    return image;
  }
  /// @brief The byte of channel `c` of the pixel at (`y`, `x`).
  uint8_t at(int64_t y, int64_t x, int64_t c) const { return pixels[static_cast<size_t>((y * width + x) * channels + c)]; }
};

/// @brief `image` with `channels` channels: gray to RGB repeats the value; RGB to gray uses the
/// ITU-R 601 luma weights (PIL's convert("L")).
inline Image convert_channels(const Image& image, int64_t channels) {
  TRAINLOOP_CHECK(channels == 1 || channels == 3, "image channels ", channels, " requested; expected 1 or 3");
  if (image.channels == channels) return image;
  Image out = Image::blank(image.height, image.width, channels);
  const int64_t n = image.height * image.width;
  for (int64_t i = 0; i < n; ++i) {
    if (channels == 3) {
      const uint8_t v = image.pixels[static_cast<size_t>(i)];
      out.pixels[static_cast<size_t>(3 * i)] = out.pixels[static_cast<size_t>(3 * i + 1)] =
          out.pixels[static_cast<size_t>(3 * i + 2)] = v;
    } else {
      const auto* p = &image.pixels[static_cast<size_t>(3 * i)];
      out.pixels[static_cast<size_t>(i)] =
          static_cast<uint8_t>(std::lround((299 * p[0] + 587 * p[1] + 114 * p[2]) / 1000.0));
    }
  }
  return out;
}

/// @brief The rectangle (top, left, height, width) of `image`, which must lie inside it.
inline Image crop(const Image& image, int64_t top, int64_t left, int64_t height, int64_t width) {
  TRAINLOOP_CHECK(top >= 0 && left >= 0 && height > 0 && width > 0 && top + height <= image.height &&
                      left + width <= image.width,
                  "crop (top ", top, ", left ", left, ", ", height, "x", width, ") does not fit a ", image.height, "x",
                  image.width, " image");
  Image out = Image::blank(height, width, image.channels);
  const size_t row = static_cast<size_t>(width * image.channels);
  for (int64_t y = 0; y < height; ++y) {
    const auto* from = &image.pixels[static_cast<size_t>(((top + y) * image.width + left) * image.channels)];
    std::copy(from, from + row, out.pixels.begin() + static_cast<std::ptrdiff_t>(y * static_cast<int64_t>(row)));
  }
  return out;
}

/// @brief `image` mirrored left to right.
inline Image flip_horizontal(Image image) {
  for (int64_t y = 0; y < image.height; ++y) {
    for (int64_t x = 0; x < image.width / 2; ++x) {
      for (int64_t c = 0; c < image.channels; ++c) {
        std::swap(image.pixels[static_cast<size_t>((y * image.width + x) * image.channels + c)],
                  image.pixels[static_cast<size_t>((y * image.width + image.width - 1 - x) * image.channels + c)]);
      }
    }
  }
  return image;
}

/// @brief `image` resized to height x width with bilinear interpolation (half-pixel centres, as
/// torchvision's resize without antialiasing).
///
/// The source columns and weights of every output column are computed once per call, not per
/// pixel, and the rows are walked through pointers (the first version indexed every tap through
/// Image::at in double precision; benchmarks/README.md, image_pipeline, has the figures).
inline Image resize(const Image& image, int64_t height, int64_t width) {
  TRAINLOOP_CHECK(height > 0 && width > 0, "resize to ", height, "x", width, "; expected a positive size");
  if (height == image.height && width == image.width) return image;
  Image out = Image::blank(height, width, image.channels);
  const int64_t channels = image.channels;
  const float scale_y = static_cast<float>(image.height) / static_cast<float>(height);
  const float scale_x = static_cast<float>(image.width) / static_cast<float>(width);
  // Per output column: byte offsets of the two source pixels and the right one's weight.
  std::vector<int64_t> left(static_cast<size_t>(width)), right(static_cast<size_t>(width));
  std::vector<float> weight(static_cast<size_t>(width));
  for (int64_t x = 0; x < width; ++x) {
    const float sx = std::clamp((static_cast<float>(x) + 0.5f) * scale_x - 0.5f, 0.0f, static_cast<float>(image.width - 1));
    const auto x0 = static_cast<int64_t>(sx);
    left[static_cast<size_t>(x)] = x0 * channels;
    right[static_cast<size_t>(x)] = std::min(x0 + 1, image.width - 1) * channels;
    weight[static_cast<size_t>(x)] = sx - static_cast<float>(x0);
  }
  const int64_t stride = image.width * channels;
  for (int64_t y = 0; y < height; ++y) {
    const float sy = std::clamp((static_cast<float>(y) + 0.5f) * scale_y - 0.5f, 0.0f, static_cast<float>(image.height - 1));
    const auto y0 = static_cast<int64_t>(sy);
    const int64_t y1 = std::min(y0 + 1, image.height - 1);
    const float fy = sy - static_cast<float>(y0);
    const uint8_t* upper = image.pixels.data() + y0 * stride;
    const uint8_t* lower = image.pixels.data() + y1 * stride;
    uint8_t* row = out.pixels.data() + y * width * channels;
    for (int64_t x = 0; x < width; ++x) {
      const size_t i = static_cast<size_t>(x);
      const float fx = weight[i];
      const uint8_t *a = upper + left[i], *b = upper + right[i], *c = lower + left[i], *d = lower + right[i];
      for (int64_t k = 0; k < channels; ++k) {
        const float top = static_cast<float>(a[k]) + (static_cast<float>(b[k]) - static_cast<float>(a[k])) * fx;
        const float bottom = static_cast<float>(c[k]) + (static_cast<float>(d[k]) - static_cast<float>(c[k])) * fx;
        const float value = top + (bottom - top) * fy;
        row[x * channels + k] = static_cast<uint8_t>(std::clamp(value + 0.5f, 0.0f, 255.0f));
      }
    }
  }
  return out;
}

}  // namespace trainloop::data
