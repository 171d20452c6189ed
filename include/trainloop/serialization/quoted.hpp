#pragma once
/// @file
/// @brief Text from a file put into an error message: quoted, its control and non-ASCII bytes
/// escaped, and cut to a few hundred bytes. A stranger's file decides what its names hold — a
/// 100 MB key, a terminal's escape sequences — and a message must neither grow with them nor
/// let them act on the terminal that prints it.

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace trainloop::serialization {

/// Bytes of the file a message quotes at most (of a name or text; the escapes may double it).
inline constexpr size_t kQuotedBytes = 200;

namespace detail {
/// `text` escaped (see escape_untrusted()), whole.
inline std::string escape_bytes(std::string_view text) {
  static constexpr char hex[] = "0123456789abcdef";
  std::string out;
  out.reserve(text.size() + 16);
  for (const char c : text) {
    const auto byte = static_cast<uint8_t>(c);
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (byte >= 0x20 && byte < 0x7f) {
          out += c;
        } else {
          out += "\\x";
          out += hex[byte >> 4];
          out += hex[byte & 0xf];
        }
    }
  }
  return out;
}
inline std::string cut_note(std::string_view text, size_t max_bytes) {
  return text.size() > max_bytes ? "... (" + std::to_string(text.size()) + " bytes in all)" : "";
}
}  // namespace detail

/// @brief `text` as Python's repr of bytes escapes it, without quotes: printable ASCII as it is
/// (backslash and double quote escaped), \\n \\r \\t, every other byte as \\xNN; at most
/// `max_bytes` bytes of it, then "... (N bytes in all)".
inline std::string escape_untrusted(std::string_view text, size_t max_bytes = kQuotedBytes) {
  return detail::escape_bytes(text.substr(0, max_bytes)) + detail::cut_note(text, max_bytes);
}

/// @brief escape_untrusted(text) in double quotes: how a message names something a file holds.
inline std::string quote_untrusted(std::string_view text, size_t max_bytes = kQuotedBytes) {
  return "\"" + detail::escape_bytes(text.substr(0, max_bytes)) + "\"" + detail::cut_note(text, max_bytes);
}

/// @brief `path` for a message when its file name came from a file (a shard an index names, a
/// DCP item's file): the directory as it is (the caller's), the name escaped and cut as
/// escape_untrusted() does, so an ordinary name reads as it is.
inline std::string untrusted_file_path(const std::filesystem::path& path) {
  return (path.parent_path() / escape_untrusted(path.filename().string())).string();
}

}  // namespace trainloop::serialization
