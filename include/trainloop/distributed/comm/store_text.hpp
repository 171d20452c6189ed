#pragma once
/// @file
/// @brief Text in the job's c10d store: a `c10d::Store` holds bytes, and trainloop's keys (the
/// watchdogs' records, elastic training's membership and admissions) hold text.

#include <cstdint>
#include <string>
#include <vector>

namespace trainloop::distributed::detail {

/// The text a store value holds.
inline std::string store_text(const std::vector<std::uint8_t>& bytes) { return std::string(bytes.begin(), bytes.end()); }
/// `text` as a store value.
inline std::vector<std::uint8_t> store_bytes(const std::string& text) { return {text.begin(), text.end()}; }

}  // namespace trainloop::distributed::detail
