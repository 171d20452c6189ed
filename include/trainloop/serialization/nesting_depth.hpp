#pragma once
/// @file
/// @brief How deep a stranger's text nests brackets, found in one pass before a parser that
/// recurses (or builds what is walked recursively) sees it: JSON before nlohmann-json, the
/// TorchScript code of an archive before libtorch's parser (issue 50: a parameter name of `b"+`
/// and 200,000 `(` crashed every resume with a stack overflow inside that parser).
///
/// Why not nlohmann's parser callback, which sees each value's depth: with a callback, nlohmann-json
/// 3.11.2 (Debian 12's) rescans the enclosing array or object each time an object ends, to drop
/// discarded values, so a list of n objects costs n^2 (measured on the 2-core AMD EPYC, GCC 12 -O2,
/// `[{"a":1}, ...]`: 5,000 elements 0.045 s, 20,000 elements 0.95 s with the callback; 0.006 s and
/// 0.015 s without). A 1.2 MB safetensors header took 21-37 s. Parsing without a callback is
/// linear; this bound comes first, in linear time too.
///
/// Hand-written: neither nlohmann-json nor libtorch's TorchScript parser has a depth limit of its
/// own, and the scan is a few lines. It counts (, [ and { outside string literals; malformed text
/// is left for the parser to refuse. Comments are not skipped: a bracket in one counts, which can
/// only refuse more.

#include <cstddef>
#include <string_view>

namespace trainloop::serialization {

/// @brief The first nesting depth beyond `max_depth` that `text` reaches (each open (, [ or {
/// outside a string literal is one level: `{"a": [1]}` is 2 deep), or 0 when it stays within.
/// @param text the text, whole (read once, left to right)
/// @param max_depth the deepest nesting allowed
/// @param quotes the characters that open a string literal, closed by the same character, with
///        backslash escapes ("\"" for JSON, "\"'" for TorchScript's Python)
inline int nesting_depth_beyond(std::string_view text, int max_depth, std::string_view quotes = "\"") {
  int depth = 0;
  char in_string = 0;  // the quote that opened the string we are in, or 0
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string != 0) {
      if (c == '\\') {
        ++i;  // the escaped character, whatever it is, does not end the string
      } else if (c == in_string) {
        in_string = 0;
      }
      continue;
    }
    if (quotes.find(c) != std::string_view::npos) {
      in_string = c;
    } else if (c == '(' || c == '[' || c == '{') {
      if (++depth > max_depth) return depth;
    } else if ((c == ')' || c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return 0;
}

/// @brief nesting_depth_beyond() for JSON.
inline int json_depth_beyond(std::string_view text, int max_depth) { return nesting_depth_beyond(text, max_depth, "\""); }

}  // namespace trainloop::serialization
