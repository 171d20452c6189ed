#pragma once
/// @file
/// @brief Hashes that every process of a job computes alike: of a string (names compared across
/// ranks, ports derived from a job's identity) and of integer keys (random streams per sample).

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

/// SplitMix64's finaliser: neighbouring keys (indices, epochs, steps) give unrelated values.
inline constexpr std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

}  // namespace trainloop::detail
