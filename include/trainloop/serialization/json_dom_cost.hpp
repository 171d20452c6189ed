#pragma once
/// @file
/// @brief What nlohmann-json's document of a stranger's JSON will hold in memory, found in one pass
/// over the text before it is parsed, so that a document costing more than a small multiple of
/// its size is refused before anything is built (issue 50: a list of empty objects `[{},{},...]`
/// cost 21-32 bytes of memory per byte of text; a 256 MiB .pt2 program would have taken ~8 GiB).
///
/// The charges are what nlohmann::json (std::map objects, std::vector arrays, std::string
/// strings) allocates on the heap with glibc's malloc on x86-64, rounded up (measured with
/// mallinfo2 around nlohmann::json::parse, GCC 12, nlohmann-json 3.11.2): an object 64 bytes, a
/// member 96 (the map node with its key and value), a string 48, an array 32, an array element 32
/// (16 for its value, twice for the vector's growth), and a key or string longer than 15 bytes
/// (beyond std::string's inline buffer) its length + 9 rounded up to 16 (malloc's chunk). Real
/// documents, charged and measured: timm resnet18's program 5.8 (5.7) bytes per byte, its weights
/// config 8.0 (7.9); `[{},{},...]` 32 (21).
///
/// Hand-written: nlohmann-json reports no memory use, and the scan is the nesting scan's
/// (nesting_depth.hpp) with a stack of what each open bracket is. Malformed text is charged as far
/// as it can be read and left for the parser to refuse.

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace trainloop::serialization {

/// @brief The heap bytes nlohmann::json's document of `text` holds at most (the charges in this
/// file's comment), in one left-to-right pass.
inline uint64_t json_dom_bytes(std::string_view text) {
  constexpr uint64_t kObject = 64, kMember = 96, kString = 48, kArray = 32, kElement = 32;
  // Beyond std::string's 15 inline bytes: length + 1 (its NUL) + 8 (malloc's header), rounded up to 16.
  const auto long_string = [](std::size_t length) -> uint64_t { return length > 15 ? (uint64_t(length) + 9 + 15) / 16 * 16 : 0; };
  // One entry per open bracket: for an object, whether a key comes next; for an array, whether
  // its current element is already charged.
  struct Open {
    bool object;
    bool flag;
  };
  std::vector<Open> open;
  uint64_t bytes = 16;  // the root value
  // A value starts here: in an array, the first character of an element charges the element.
  const auto value_starts = [&] {
    if (!open.empty() && !open.back().object && !open.back().flag) {
      bytes += kElement;
      open.back().flag = true;
    }
  };
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    switch (c) {
      case '"': {
        std::size_t end = i + 1;
        while (end < text.size() && text[end] != '"') end += text[end] == '\\' ? 2 : 1;
        const std::size_t length = end - i - 1;  // escaped, so at least the decoded length
        if (!open.empty() && open.back().object && open.back().flag) {
          bytes += kMember + long_string(length);
          open.back().flag = false;
        } else {
          value_starts();
          bytes += kString + long_string(length);
        }
        i = end;
        break;
      }
      case '{':
      case '[':
        value_starts();
        bytes += c == '{' ? kObject : kArray;
        open.push_back({c == '{', c == '{'});
        break;
      case '}':
      case ']':
        if (!open.empty()) open.pop_back();
        break;
      case ',':
        if (!open.empty()) open.back().flag = open.back().object;  // a key next; or a new element
        break;
      case ' ':
      case '\t':
      case '\r':
      case '\n':
      case ':':
        break;
      default:  // a number, true, false or null: only its place in an array costs
        value_starts();
        break;
    }
  }
  return bytes;
}

}  // namespace trainloop::serialization
