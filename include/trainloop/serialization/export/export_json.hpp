#pragma once
/// @file
/// @brief JSON from a stranger's PT2 archive, read with nlohmann-json: parsed with its nesting
/// bounded, and read only through accessors that check each value's type and throw a
/// trainloop::CheckpointError naming where it is (never nlohmann's own exceptions, never a
/// default-constructed value). Also the export schema's enums that are not JSON's
/// (torch/_export/serde/schema.yaml: ScalarType).

#include <trainloop/error.hpp>
#include <trainloop/serialization/json_dom_cost.hpp>
#include <trainloop/serialization/nesting_depth.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

// GCC 13 and later warn (-Wdangling-reference, part of -Wall) at every
// `const auto& member = json_member(document, "key", where + "...")`: the heuristic takes the result
// for a reference into the temporary message string (GCC bug 107532), while json_member returns a
// reference into `document`, which outlives it. Seen on the GPU machine's GCC 13.3 (2026-11-29: 12
// warnings); the headers that bind such references put their code between these two.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 13
#define TRAINLOOP_JSON_REFERENCES_BEGIN \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wdangling-reference\"")
#define TRAINLOOP_JSON_REFERENCES_END _Pragma("GCC diagnostic pop")
#else
#define TRAINLOOP_JSON_REFERENCES_BEGIN
#define TRAINLOOP_JSON_REFERENCES_END
#endif

namespace trainloop::serialization {

/// @brief How much memory parse_untrusted_json() lets a document's nlohmann::json take: this many
/// bytes per byte of its text (json_dom_cost.hpp's charges; real documents take 6-8: timm
/// resnet18's program 5.8, its weights config 8.0), plus kJsonMemorySlack for small documents.
inline constexpr uint64_t kJsonMemoryPerByte = 16;
/// @brief See kJsonMemoryPerByte.
inline constexpr uint64_t kJsonMemorySlack = uint64_t(1) << 20;

/// @brief Parses `text` as JSON, refusing first (each in one pass, so in time linear in its size)
/// nesting deeper than `max_depth` (nesting_depth.hpp: what is built from the document is walked
/// recursively) and a document whose nlohmann::json would take more than kJsonMemoryPerByte bytes
/// per byte of text plus kJsonMemorySlack (json_dom_cost.hpp). So reading it takes at most
/// 16 N + 1 MiB bytes of memory besides the text.
/// @throws trainloop::CheckpointError naming `what` for malformed, too deeply nested or too costly JSON.
inline nlohmann::json parse_untrusted_json(std::string_view text, const std::string& what, int max_depth) {
  if (const int depth = json_depth_beyond(text, max_depth)) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", what, " nests JSON ", depth,
                                                    " levels deep; expected at most ", max_depth));
  }
  const uint64_t budget = kJsonMemoryPerByte * text.size() + kJsonMemorySlack;
  if (const uint64_t bytes = json_dom_bytes(text); bytes > budget) {
    throw CheckpointError(trainloop::detail::concat(
        "trainloop: ", what, " is JSON of ", text.size(), " bytes whose document would take ", bytes,
        " bytes of memory; expected at most ", budget, " (", kJsonMemoryPerByte,
        " bytes per byte + 1 MiB; real programs take 6-8 per byte, a list of empty objects 32)"));
  }
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& error) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", what, " is not valid JSON (",
                                                    escape_untrusted(error.what()), "); expected the export schema's JSON"));
  }
}

/// @brief The member `key` of JSON object `object`, or throws naming `where`.
inline const nlohmann::json& json_member(const nlohmann::json& object, const char* key, const std::string& where) {
  if (!object.is_object()) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is ", object.type_name(),
                                                    "; expected a JSON object with '", escape_untrusted(key), "'"));
  }
  const auto found = object.find(key);
  if (found == object.end()) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has no '", escape_untrusted(key), "'; expected one"));
  }
  return *found;
}

/// @brief `value` as a 64-bit integer, or throws naming `where`.
inline int64_t json_int(const nlohmann::json& value, const std::string& where) {
  if (!value.is_number_integer()) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is ", value.type_name(), " ",
                                                    escape_untrusted(value.dump().substr(0, 80)), "; expected an integer"));
  }
  return value.get<int64_t>();
}

/// @brief `value` as a string, or throws naming `where`.
inline const std::string& json_string(const nlohmann::json& value, const std::string& where) {
  if (!value.is_string()) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is ", value.type_name(), "; expected a string"));
  }
  return value.get_ref<const std::string&>();
}

/// @brief A union of the export schema (`{"as_int": 3}`): its one field's name and value.
/// @throws trainloop::CheckpointError naming `where` when it is not an object of one field.
inline std::pair<std::string, const nlohmann::json*> json_union(const nlohmann::json& value, const std::string& where) {
  if (!value.is_object() || value.size() != 1) {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is ", escape_untrusted(value.dump().substr(0, 80)),
                                                    "; expected an export-schema union (an object of one field)"));
  }
  return {value.begin().key(), &value.begin().value()};
}

/// @brief The export schema's ScalarType number as libtorch's (schema.yaml's ScalarType enum).
/// @throws trainloop::CheckpointError naming `where` for a number trainloop does not read.
inline torch::ScalarType export_scalar_type(int64_t code, const std::string& where) {
  switch (code) {
    case 1: return torch::kUInt8;
    case 2: return torch::kInt8;
    case 3: return torch::kInt16;
    case 4: return torch::kInt32;
    case 5: return torch::kInt64;
    case 6: return torch::kFloat16;
    case 7: return torch::kFloat32;
    case 8: return torch::kFloat64;
    case 10: return torch::kComplexFloat;
    case 11: return torch::kComplexDouble;
    case 12: return torch::kBool;
    case 13: return torch::kBFloat16;
    default:
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has the export ScalarType ", code,
                                                      "; expected one of 1-8, 10-13 (uint8 ... bfloat16)"));
  }
}

}  // namespace trainloop::serialization
