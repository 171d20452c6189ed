#pragma once
/// @file
/// @brief A hash of a string that every process of a job computes alike (names compared across
/// ranks, ports derived from a job's identity).

#include <cstdint>
#include <string_view>

namespace trainloop::detail {

/// FNV-1a, kept to 63 bits so it survives as a non-negative int64 tensor element. std::hash is
/// not guaranteed to agree between differently built binaries; this is.
inline std::int64_t stable_hash(std::string_view text, std::uint64_t seed = 1469598103934665603ULL) {
  std::uint64_t hash = seed;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ULL;
  }
  return static_cast<std::int64_t>(hash >> 1);
}

}  // namespace trainloop::detail
