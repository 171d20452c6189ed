#pragma once
/// @file
/// @brief The check every reader makes of a BOOL tensor's bytes: libtorch's kernels assume 0 or 1,
/// and any other byte is undefined behaviour there (a file that passes one reader must pass all:
/// dcp_to_safetensors used to write what load_safetensors then refused, issue 50).

#include <algorithm>
#include <cstddef>

namespace trainloop::serialization {

/// @brief The offset of the first of `size` bytes at `data` that is neither 0 nor 1, or `size`
/// when every byte is a valid bool.
inline std::size_t first_invalid_bool_byte(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  return static_cast<std::size_t>(std::find_if(bytes, bytes + size, [](unsigned char v) { return v > 1; }) - bytes);
}

}  // namespace trainloop::serialization
