#pragma once
/// @file
/// @brief Reads IDX files (the MNIST family's format), gzip-compressed or plain, into a tensor.
///
/// IDX: a 4-byte magic number `0 0 <type> <ndims>`, then `ndims` big-endian uint32 sizes, then
/// the values, big-endian, row-major. zlib's gzread reads plain files transparently, so one
/// reader serves both `.gz` and uncompressed files.

#include <trainloop/error.hpp>

#include <torch/types.h>

#include <zlib.h>

#include <algorithm>
#include <array>
#include <bit>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace trainloop::data {

/// IDX magic number of an MNIST-style image file: unsigned bytes, 3 dimensions (N, rows, cols).
inline constexpr uint32_t kIdxImagesMagic = 2051;
/// IDX magic number of an MNIST-style label file: unsigned bytes, 1 dimension (N).
inline constexpr uint32_t kIdxLabelsMagic = 2049;

}  // namespace trainloop::data

namespace trainloop::detail {

/// The element type an IDX type code stands for, in words: "unsigned bytes".
inline const char* idx_type_name(uint8_t type_code) {
  switch (type_code) {
    case 0x08: return "unsigned bytes";
    case 0x09: return "signed bytes";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown type";
  }
}

/// Describes an IDX magic number for error messages: "unsigned bytes, 3 dimensions".
inline std::string describe_idx_magic(uint32_t magic) {
  return concat(idx_type_name(static_cast<uint8_t>((magic >> 8) & 0xFF)), ", ", magic & 0xFF,
                " dimensions");
}

/// The tensor dtype of an IDX type code, or nullopt for a code the format does not define.
inline std::optional<torch::ScalarType> idx_scalar_type(uint8_t type_code) {
  switch (type_code) {
    case 0x08: return torch::kUInt8;
    case 0x09: return torch::kInt8;
    case 0x0B: return torch::kInt16;
    case 0x0C: return torch::kInt32;
    case 0x0D: return torch::kFloat32;
    case 0x0E: return torch::kFloat64;
    default: return std::nullopt;
  }
}

/// RAII gzFile that reports short reads with the file name and what was being read.
class GzReader {
 public:
  explicit GzReader(std::filesystem::path path) : path_(std::move(path)) {
    file_ = gzopen(path_.c_str(), "rb");
    TRAINLOOP_CHECK(file_ != nullptr, "cannot open ", path_.string(),
                    (std::filesystem::exists(path_) ? " (exists but is not readable)"
                                                    : " (no such file)"),
                    "; expected a readable IDX file");
    gzbuffer(file_, 1 << 17);  // fewer, larger reads of the compressed stream
  }
  GzReader(const GzReader&) = delete;
  GzReader& operator=(const GzReader&) = delete;
  ~GzReader() { gzclose(file_); }

  /// Reads exactly `count` bytes into `out`, or throws naming `what` and how far it got.
  void read_exactly(void* out, size_t count, const std::string& what) {
    auto* bytes = static_cast<unsigned char*>(out);
    size_t done = 0;
    while (done < count) {
      const auto chunk = static_cast<unsigned>(std::min<size_t>(count - done, INT_MAX / 2));
      const int got = gzread(file_, bytes + done, chunk);
      // -1 comes without a count of what was decoded before the error (e.g. a bad CRC).
      TRAINLOOP_CHECK(got >= 0, path_.string(), " is corrupt (", zlib_error(), ") while reading ",
                      what, "; expected a valid gzip or plain IDX file");
      if (got == 0) {
        throw Error(concat("trainloop: ", path_.string(), " is truncated or corrupt (",
                           has_error() ? zlib_error() : "unexpected end of data", "): read ",
                           done, " of ", count, " bytes of ", what,
                           "; expected the complete file"));
      }
      done += static_cast<size_t>(got);
      total_read_ += static_cast<uint64_t>(got);
    }
  }

  /// Throws if the stream holds more bytes, or its gzip trailer (CRC, length) is bad or cut.
  void expect_end(const std::string& what_was_expected) {
    unsigned char extra = 0;
    const int got = gzread(file_, &extra, 1);
    TRAINLOOP_CHECK(got >= 0 && !has_error(), path_.string(), " is truncated or corrupt after its data (",
                    zlib_error(), "); expected a complete gzip stream after ", what_was_expected);
    TRAINLOOP_CHECK(got == 0, path_.string(), " has more bytes than its IDX header declares; ",
                    "expected exactly ", what_was_expected);
    if (gzdirect(file_) == 0) check_gzip_length_trailer();
  }

  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  bool has_error() const {
    int code = Z_OK;
    gzerror(file_, &code);
    return code != Z_OK;
  }

  std::string zlib_error() const {
    int code = Z_OK;
    const char* raw = gzerror(file_, &code);
    std::string message = raw != nullptr && *raw != '\0' ? raw : "read error";
    // zlib prefixes the path, which our messages already name.
    const std::string prefix = path_.string() + ": ";
    if (message.rfind(prefix, 0) == 0) message.erase(0, prefix.size());
    return message;
  }

  /// gzread treats a file cut inside its 8-byte trailer as complete when the data itself is
  /// (it stops at end of input without asking inflate for the trailer), so compare the
  /// trailer's length field (uncompressed size mod 2^32, last 4 bytes, little-endian) with what
  /// was read. Assumes one gzip member, as gzip and the dataset packages write.
  void check_gzip_length_trailer() const {
    std::ifstream raw(path_, std::ios::binary | std::ios::ate);
    const auto file_size = static_cast<std::streamoff>(raw.tellg());
    TRAINLOOP_CHECK(raw && file_size >= 18, path_.string(), " is truncated (", file_size,
                    " bytes); expected a gzip file with its 8-byte trailer");
    std::array<unsigned char, 4> b{};
    raw.seekg(file_size - 4);
    raw.read(reinterpret_cast<char*>(b.data()), b.size());
    const uint32_t recorded =
        uint32_t{b[0]} | (uint32_t{b[1]} << 8) | (uint32_t{b[2]} << 16) | (uint32_t{b[3]} << 24);
    const auto expected = static_cast<uint32_t>(total_read_ & 0xFFFFFFFFu);
    TRAINLOOP_CHECK(raw && recorded == expected, path_.string(),
                    " is truncated or corrupt: its gzip trailer records ", recorded,
                    " bytes (mod 2^32) but ", total_read_,
                    " were decoded; expected a complete gzip file (was it cut short?)");
  }

  std::filesystem::path path_;
  gzFile file_ = nullptr;
  uint64_t total_read_ = 0;
};

inline uint32_t read_big_endian_u32(GzReader& in, const std::string& what) {
  std::array<unsigned char, 4> b{};
  in.read_exactly(b.data(), b.size(), what);
  return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) | (uint32_t{b[2]} << 8) | uint32_t{b[3]};
}

/// Reverses the bytes of every `width`-byte element in place (IDX is big-endian).
inline void swap_element_bytes(unsigned char* data, size_t bytes, size_t width) {
  for (size_t offset = 0; offset + width <= bytes; offset += width) {
    std::reverse(data + offset, data + offset + width);
  }
}

}  // namespace trainloop::detail

namespace trainloop::data {

/// @brief Reads an IDX file (gzip-compressed or plain) into a tensor of its own dtype and shape.
/// @param path the file, e.g. `train-images-idx3-ubyte.gz`.
/// @param expected_magic when given, the file's magic number must equal it (e.g.
///        kIdxImagesMagic), so a labels file passed as images fails with a clear message.
/// @return a CPU tensor shaped by the header's sizes (uint8 for MNIST-style files).
/// @throws trainloop::Error naming the file when it is missing, has a wrong or unknown magic
///         number, or is truncated/corrupt (with how many bytes of what were read).
inline torch::Tensor read_idx(const std::filesystem::path& path,
                              std::optional<uint32_t> expected_magic = std::nullopt) {
  detail::GzReader in(path);
  const uint32_t magic = detail::read_big_endian_u32(in, "the IDX magic number");
  if (expected_magic) {
    TRAINLOOP_CHECK(magic == *expected_magic, path.string(), " has IDX magic number ", magic,
                    "; expected ", *expected_magic, " (",
                    detail::describe_idx_magic(*expected_magic), ")");
  }
  const auto type_code = static_cast<uint8_t>((magic >> 8) & 0xFF);
  const auto scalar_type = detail::idx_scalar_type(type_code);
  TRAINLOOP_CHECK((magic >> 16) == 0 && scalar_type.has_value() && (magic & 0xFF) > 0,
                  path.string(), " has magic number ", magic,
                  ", which is not an IDX header; expected 0x0000TTDD with type TT in "
                  "{08,09,0B,0C,0D,0E} and DD >= 1 dimensions");

  const size_t dims = magic & 0xFF;
  const size_t element_size = c10::elementSize(*scalar_type);
  size_t total_bytes = element_size;
  std::vector<int64_t> sizes;
  std::string shape;
  for (size_t d = 0; d < dims; ++d) {
    const uint32_t size = detail::read_big_endian_u32(in, detail::concat("IDX dimension ", d, " size"));
    sizes.push_back(size);
    shape += detail::concat(d == 0 ? "" : "x", size);
    TRAINLOOP_CHECK(size == 0 || total_bytes <= std::numeric_limits<size_t>::max() / size,
                    path.string(), " declares an impossible shape ", shape,
                    "; expected a tensor that fits in memory");
    total_bytes *= size;
  }

  auto tensor = torch::empty(sizes, torch::TensorOptions().dtype(*scalar_type));
  const std::string what =
      detail::concat("data (IDX header declares ", shape, " ", detail::idx_type_name(type_code), ")");
  auto* bytes = static_cast<unsigned char*>(tensor.data_ptr());
  in.read_exactly(bytes, total_bytes, what);
  in.expect_end(detail::concat(total_bytes, " bytes of ", what));
  if (element_size > 1 && std::endian::native == std::endian::little) {
    detail::swap_element_bytes(bytes, total_bytes, element_size);
  }
  return tensor;
}

}  // namespace trainloop::data
