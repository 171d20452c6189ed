#pragma once
/// @file
/// @brief The bytes of one pickle, read forward by serialization/pickle/pickle_reader.hpp's unpickler:
/// each read checked against the end, so a truncated file is an error, never a read past it.

#include <trainloop/serialization/pickle/tensor_rebuild.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace trainloop::serialization {

/// @brief A position in one pickle's bytes, and the reads an opcode's arguments need.
class PickleCursor {
 public:
  /// @param bytes the pickle; must outlive the cursor
  explicit PickleCursor(std::string_view bytes) : bytes_(bytes) {}

  /// The whole pickle.
  std::string_view bytes() const { return bytes_; }
  /// The offset of the next byte to read.
  size_t position() const { return pos_; }

  /// The next `count` bytes.
  /// @throws PickleError when fewer are left.
  std::string_view take(size_t count) {
    if (count > bytes_.size() - pos_) pickle_fail("the pickle is truncated");
    const auto piece = bytes_.substr(pos_, count);
    pos_ += count;
    return piece;
  }
  /// The next byte, as a number (an opcode, or a one-byte argument).
  uint8_t byte() { return static_cast<uint8_t>(take(1)[0]); }
  /// The next integer of type T: pickle's integer arguments are little-endian, as this machine.
  template <class T>
  T little_endian() {
    T value;
    std::memcpy(&value, take(sizeof(T)).data(), sizeof(T));
    return value;
  }
  /// The text up to the next newline, which is read but not returned (GLOBAL's "module\nname\n").
  std::string_view line() {
    const auto end = bytes_.find('\n', pos_);
    if (end == std::string_view::npos) pickle_fail("the pickle is truncated");
    const size_t length = end - pos_;
    return take(length + 1).substr(0, length);
  }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
};

}  // namespace trainloop::serialization
