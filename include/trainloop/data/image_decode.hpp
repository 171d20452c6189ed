#pragma once
/// @file
/// @brief Decoding JPEG (libjpeg-turbo), PNG (libpng) and PPM/PGM (a few lines, no library) into
/// an Image, with errors that name the file.
///
/// JPEG and PNG are optional dependencies of the CMake package: `trainloop::trainloop` defines
/// TRAINLOOP_WITH_JPEG / TRAINLOOP_WITH_PNG and links the libraries when CMake finds them (Debian:
/// libjpeg62-turbo-dev, libpng-dev). Without one, decoding that format is a trainloop::Error naming
/// the file and the package to install — not a link failure.
///
/// JPEG: when the caller wants a much smaller image, libjpeg-turbo's scaled decoding (1/2, 1/4, 1/8
/// of the size, done inside the IDCT) decodes only what is needed. A file that ends early (libjpeg
/// only warns, and fills the rest with grey) is an error here.

#include <trainloop/data/image.hpp>
#include <trainloop/error.hpp>

#include <algorithm>
#include <cctype>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#ifdef TRAINLOOP_WITH_JPEG
#include <jerror.h>
#include <jpeglib.h>
#endif
#ifdef TRAINLOOP_WITH_PNG
#include <png.h>
#endif

namespace trainloop::data {

/// @brief What to decode to: `channels` 1 (gray) or 3 (RGB), 0 for the file's own (gray stays gray,
/// everything else becomes RGB); images at least `min_height` x `min_width` (0: full size) may be
/// decoded smaller than stored (JPEG).
struct DecodeRequest {
  int64_t channels = 0;    ///< 0, 1 or 3
  int64_t min_height = 0;  ///< smallest useful height (0: full size)
  int64_t min_width = 0;   ///< smallest useful width (0: full size)
};

/// @brief The image formats ImageFolder reads, by file extension (lower case, with the dot).
inline bool is_image_extension(std::string extension) {
  std::transform(extension.begin(), extension.end(), extension.begin(), [](unsigned char c) { return std::tolower(c); });
  return extension == ".jpg" || extension == ".jpeg" || extension == ".png" || extension == ".ppm" || extension == ".pgm";
}

namespace image_io {

/// Throws the error for an image that cannot be decoded, naming the file and why.
[[noreturn]] inline void bad_image(const std::filesystem::path& path, const std::string& why) {
  throw ConfigurationError(::trainloop::detail::concat("trainloop: cannot decode image ", path.string(), ": ", why,
                                                       "; expected a complete JPEG, PNG, PPM or PGM file"));
}

/// The whole file.
inline std::vector<uint8_t> read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) bad_image(path, "it cannot be opened");
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

/// The gray image becomes RGB or the other way when `wanted` says so (0: keep).
inline Image to_channels(Image image, int64_t wanted) {
  return wanted == 0 || wanted == image.channels ? image : convert_channels(image, wanted);
}

/// Binary PGM (P5) and PPM (P6), 8 bits per sample.
inline Image decode_netpbm(const std::filesystem::path& path, const std::vector<uint8_t>& bytes, int64_t channels) {
  size_t at = 0;
  auto token = [&]() -> std::string {
    while (at < bytes.size()) {
      if (bytes[at] == '#') {
        while (at < bytes.size() && bytes[at] != '\n') ++at;
      } else if (std::isspace(bytes[at])) {
        ++at;
      } else {
        break;
      }
    }
    std::string text;
    while (at < bytes.size() && !std::isspace(bytes[at])) text += static_cast<char>(bytes[at++]);
    return text;
  };
  const std::string magic = token();
  if (magic != "P5" && magic != "P6") bad_image(path, "not a binary PGM (P5) or PPM (P6) file");
  Image image;
  image.channels = magic == "P5" ? 1 : 3;
  try {
    image.width = std::stoll(token());
    image.height = std::stoll(token());
    if (std::stoll(token()) != 255) bad_image(path, "only 8-bit samples (maxval 255) are read");
  } catch (const std::logic_error&) {
    bad_image(path, "its header is malformed");
  }
  ++at;  // the single whitespace after maxval
  const size_t size = static_cast<size_t>(image.width * image.height * image.channels);
  if (image.width <= 0 || image.height <= 0 || at + size > bytes.size()) bad_image(path, "it is truncated");
  image.pixels.assign(bytes.begin() + static_cast<std::ptrdiff_t>(at),
                      bytes.begin() + static_cast<std::ptrdiff_t>(at + size));
  return to_channels(std::move(image), channels);
}

#ifdef TRAINLOOP_WITH_JPEG
/// libjpeg reports errors by calling error_exit, which must not return: jump back to the decoder.
struct JpegErrorManager {
  jpeg_error_mgr base;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
  bool truncated;
};
extern "C" inline void trainloop_jpeg_error_exit(j_common_ptr info) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(info->err);
  (*info->err->format_message)(info, manager->message);
  std::longjmp(manager->jump, 1);
}
extern "C" inline void trainloop_jpeg_emit_message(j_common_ptr info, int level) {
  auto* manager = reinterpret_cast<JpegErrorManager*>(info->err);
  if (level < 0 && info->err->msg_code == JWRN_JPEG_EOF) manager->truncated = true;  // libjpeg fills grey
}

/// Decodes with libjpeg; the only objects alive across setjmp are plain C structs and the caller's
/// vector, so the longjmp skips no destructor.
inline bool decode_jpeg_into(const std::vector<uint8_t>& bytes, int64_t channels, const DecodeRequest& request,
                             Image& image, JpegErrorManager& errors) {
  jpeg_decompress_struct info{};
  info.err = jpeg_std_error(&errors.base);
  errors.base.error_exit = trainloop_jpeg_error_exit;
  errors.base.emit_message = trainloop_jpeg_emit_message;
  errors.truncated = false;
  if (setjmp(errors.jump)) {
    jpeg_destroy_decompress(&info);
    return false;
  }
  jpeg_create_decompress(&info);
  jpeg_mem_src(&info, bytes.data(), static_cast<unsigned long>(bytes.size()));
  jpeg_read_header(&info, TRUE);
  const bool gray_file = info.num_components == 1;
  const int64_t wanted = channels != 0 ? channels : (gray_file ? 1 : 3);
  info.out_color_space = wanted == 1 ? JCS_GRAYSCALE : JCS_RGB;
  // The smallest of 1/8, 1/4, 1/2 that still covers the request; libjpeg-turbo scales in the IDCT.
  unsigned denominator = 1;
  if (request.min_height > 0 && request.min_width > 0) {
    for (unsigned d : {8u, 4u, 2u}) {
      if ((info.image_width + d - 1) / d >= request.min_width && (info.image_height + d - 1) / d >= request.min_height) {
        denominator = d;
        break;
      }
    }
  }
  info.scale_num = 1;
  info.scale_denom = denominator;
  jpeg_start_decompress(&info);
  image.width = info.output_width;
  image.height = info.output_height;
  image.channels = info.output_components;
  image.pixels.resize(static_cast<size_t>(image.width * image.height * image.channels));
  while (info.output_scanline < info.output_height) {
    JSAMPROW row = image.pixels.data() + static_cast<size_t>(info.output_scanline) * static_cast<size_t>(image.width * image.channels);
    jpeg_read_scanlines(&info, &row, 1);
  }
  jpeg_finish_decompress(&info);
  jpeg_destroy_decompress(&info);
  return true;
}
#endif

/// libjpeg-turbo decoding (scaled when the request allows), or an error when not compiled in.
inline Image decode_jpeg(const std::filesystem::path& path, const std::vector<uint8_t>& bytes, const DecodeRequest& request) {
#ifdef TRAINLOOP_WITH_JPEG
  Image image;
  JpegErrorManager errors{};
  if (!decode_jpeg_into(bytes, request.channels, request, image, errors)) bad_image(path, errors.message);
  if (errors.truncated) bad_image(path, "it ends early (truncated)");
  return image;
#else
  (void)bytes;
  (void)request;
  bad_image(path, "JPEG support was not compiled in (libjpeg was not found when the project was configured: install "
                  "libjpeg62-turbo-dev and configure again)");
#endif
}

/// libpng decoding (palettes, alpha and 16-bit converted), or an error when not compiled in.
inline Image decode_png(const std::filesystem::path& path, const std::vector<uint8_t>& bytes, int64_t channels) {
#ifdef TRAINLOOP_WITH_PNG
  png_image info{};
  info.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&info, bytes.data(), bytes.size())) bad_image(path, info.message);
  const bool gray_file = (info.format & PNG_FORMAT_FLAG_COLOR) == 0;
  const int64_t wanted = channels != 0 ? channels : (gray_file ? 1 : 3);
  info.format = wanted == 1 ? PNG_FORMAT_GRAY : PNG_FORMAT_RGB;  // palettes, alpha, 16 bits converted
  Image image;
  image.width = info.width;
  image.height = info.height;
  image.channels = wanted;
  image.pixels.resize(PNG_IMAGE_SIZE(info));
  if (!png_image_finish_read(&info, nullptr, image.pixels.data(), 0, nullptr)) {
    const std::string why = info.message;
    png_image_free(&info);
    bad_image(path, why);
  }
  return image;
#else
  (void)bytes;
  (void)channels;
  bad_image(path, "PNG support was not compiled in (libpng was not found when the project was configured: install "
                  "libpng-dev and configure again)");
#endif
}

}  // namespace image_io

/// @brief Decodes the image file at `path` (JPEG, PNG, PPM or PGM, by its first bytes).
/// @throws trainloop::ConfigurationError naming the file when it cannot be read or decoded, is
///         truncated or corrupt, or its format was not compiled in.
inline Image decode_image(const std::filesystem::path& path, const DecodeRequest& request = {}) {
  TRAINLOOP_CHECK(request.channels == 0 || request.channels == 1 || request.channels == 3, "decode channels ",
                  request.channels, "; expected 0 (the file's), 1 or 3");
  const std::vector<uint8_t> bytes = image_io::read_bytes(path);
  if (bytes.size() >= 3 && bytes[0] == 0xFF && bytes[1] == 0xD8 && bytes[2] == 0xFF) return image_io::decode_jpeg(path, bytes, request);
  if (bytes.size() >= 8 && bytes[0] == 0x89 && bytes[1] == 'P' && bytes[2] == 'N' && bytes[3] == 'G') {
    return image_io::decode_png(path, bytes, request.channels);
  }
  if (bytes.size() >= 2 && bytes[0] == 'P' && (bytes[1] == '5' || bytes[1] == '6')) {
    return image_io::decode_netpbm(path, bytes, request.channels);
  }
  image_io::bad_image(path, bytes.empty() ? "it is empty" : "it is not a JPEG, PNG, PPM or PGM file (unknown signature)");
}

}  // namespace trainloop::data
