#pragma once
/// @file
/// @brief The header of a safetensors file (huggingface/safetensors): its dtypes, its entries, and
/// the checks that make a stranger's header safe to read by: every entry's bytes inside the data,
/// of the size its dtype and shape say, and the data covered exactly (no holes, no overlaps).
///
/// The format: an 8-byte little-endian u64 N, N bytes of JSON (may end in spaces), then the data.
/// The JSON is an object mapping each tensor's name to `{"dtype", "shape", "data_offsets": [begin,
/// end]}` (offsets into the data, after the header) and an optional `"__metadata__"` object of
/// strings. The data is raw, little-endian and row-major.

#include <trainloop/error.hpp>
#include <trainloop/serialization/json_sax_reader.hpp>
#include <trainloop/serialization/nesting_depth.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

// The data is little-endian and is copied into tensors as it is: a big-endian host would need swaps.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "trainloop's safetensors reader assumes a little-endian host");

namespace trainloop::serialization {

/// @brief The largest header a reader accepts: safetensors' own limit (MAX_HEADER_SIZE, 100 MB).
inline constexpr uint64_t kSafetensorsMaxHeaderBytes = 100'000'000;

/// @brief One tensor of a safetensors file, as its header describes it.
struct SafetensorsEntry {
  std::string name;             ///< the tensor's name (a state_dict's dotted name)
  torch::ScalarType dtype{};    ///< its element type
  std::vector<int64_t> shape;   ///< its sizes (empty: a scalar)
  uint64_t begin = 0;           ///< its first byte in the data (after the header)
  uint64_t end = 0;             ///< one past its last byte in the data
  /// @brief The number of elements (checked not to overflow when the header was read).
  int64_t numel() const {
    int64_t n = 1;
    for (const auto size : shape) n *= size;
    return n;
  }
};

/// @brief A parsed and checked header: the entries in the order of their data, and the metadata.
struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;        ///< by data offset (the file's order)
  std::map<std::string, std::string> metadata;  ///< `__metadata__`, empty when absent
};

namespace detail {

/// The dtypes trainloop reads and writes, by safetensors' names.
inline const std::vector<std::pair<std::string_view, torch::ScalarType>>& safetensors_dtypes() {
  static const std::vector<std::pair<std::string_view, torch::ScalarType>> table = {
      {"F64", torch::kFloat64}, {"F32", torch::kFloat32}, {"F16", torch::kFloat16}, {"BF16", torch::kBFloat16},
      {"I64", torch::kInt64},   {"I32", torch::kInt32},   {"I16", torch::kInt16},   {"I8", torch::kInt8},
      {"U8", torch::kUInt8},    {"BOOL", torch::kBool},
      {"F8_E4M3", torch::kFloat8_e4m3fn}, {"F8_E5M2", torch::kFloat8_e5m2},
  };
  return table;
}

/// "F64, F32, ..." for messages.
inline std::string safetensors_dtype_list() {
  std::string text;
  for (const auto& [name, type] : safetensors_dtypes()) text += (text.empty() ? "" : ", ") + std::string(name);
  return text;
}

/// A JSON value from the file for a message: a string quoted, anything else as JSON, both cut.
inline std::string json_text(const nlohmann::json& value) {
  return value.is_string() ? quote_untrusted(value.get_ref<const std::string&>()) : escape_untrusted(value.dump(), 80);
}

/// The error of file `file`: "trainloop: safetensors file <file> <what>".
inline CheckpointError safetensors_error(const std::string& file, const std::string& what) {
  return CheckpointError("trainloop: safetensors file " + file + " " + what);
}

}  // namespace detail

/// @brief The torch dtype of safetensors' dtype name ("F32"), or nothing for a name trainloop does
/// not read.
inline std::optional<torch::ScalarType> safetensors_dtype(std::string_view name) {
  for (const auto& [known, type] : detail::safetensors_dtypes()) {
    if (known == name) return type;
  }
  return std::nullopt;
}

/// @brief safetensors' name of `dtype` ("F32").
/// @throws trainloop::ConfigurationError for a dtype safetensors cannot hold here (complex, uint16...).
inline std::string safetensors_dtype_name(torch::ScalarType dtype) {
  for (const auto& [name, type] : detail::safetensors_dtypes()) {
    if (type == dtype) return std::string(name);
  }
  TRAINLOOP_CHECK(false, "dtype ", dtype, " has no safetensors name; expected one of ", detail::safetensors_dtype_list());
  return {};
}

namespace detail {

/// `value` as an unsigned 64-bit integer, or throws naming `where`.
inline uint64_t header_u64(const nlohmann::json& value, const std::string& file, const std::string& where) {
  if (value.is_number_unsigned()) return value.get<uint64_t>();
  if (value.is_number_integer() && value.get<int64_t>() >= 0) return static_cast<uint64_t>(value.get<int64_t>());
  throw safetensors_error(file, trainloop::detail::concat("has ", where, " = ", escape_untrusted(value.dump(), 80),
                                                          "; expected a non-negative integer"));
}

/// One entry's object checked: dtype known, shape of non-negative sizes whose bytes fit an
/// int64, offsets in order, inside the data and as many as the shape needs.
inline SafetensorsEntry parse_entry(const std::string& name, const nlohmann::json& info, uint64_t data_bytes,
                                    const std::string& file) {
  const std::string where = "tensor " + quote_untrusted(name);
  if (!info.is_object()) {
    throw safetensors_error(file, trainloop::detail::concat("has ", where, " as JSON ", info.type_name(),
                                                            "; expected an object with dtype, shape and data_offsets"));
  }
  for (const char* key : {"dtype", "shape", "data_offsets"}) {
    if (!info.contains(key)) throw safetensors_error(file, "has " + where + " without '" + key + "'; expected one");
  }
  SafetensorsEntry entry;
  entry.name = name;
  const auto& dtype = info["dtype"];
  const auto known = dtype.is_string() ? safetensors_dtype(dtype.get<std::string>()) : std::nullopt;
  if (!known) {
    throw safetensors_error(file, "has " + where + " of dtype " + json_text(dtype) +
                                      "; expected one of " + safetensors_dtype_list());
  }
  entry.dtype = *known;
  const auto& shape = info["shape"];
  if (!shape.is_array()) throw safetensors_error(file, "has " + where + "'s shape as JSON " + shape.type_name() + "; expected an array");
  const auto item = static_cast<int64_t>(c10::elementSize(entry.dtype));
  int64_t bytes = item;
  for (const auto& size : shape) {
    if (!size.is_number_integer() || (!size.is_number_unsigned() && size.get<int64_t>() < 0)) {
      throw safetensors_error(file, "has " + where + " of shape " + escape_untrusted(shape.dump(), 80) +
                                        "; expected non-negative integer sizes");
    }
    if (size.is_number_unsigned() && size.get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max())) {
      throw safetensors_error(file, "has " + where + " of shape " + escape_untrusted(shape.dump(), 80) +
                                        ", whose byte count overflows int64; expected a shape that fits the file");
    }
    const int64_t value = size.get<int64_t>();
    entry.shape.push_back(value);
    if (value != 0 && bytes > std::numeric_limits<int64_t>::max() / value) {
      throw safetensors_error(file, "has " + where + " of shape " + escape_untrusted(shape.dump(), 80) +
                                        ", whose byte count overflows int64; expected a shape that fits the file");
    }
    bytes *= value;
  }
  const auto& offsets = info["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    throw safetensors_error(file, "has " + where + "'s data_offsets = " + escape_untrusted(offsets.dump(), 80) +
                                      "; expected [begin, end]");
  }
  entry.begin = header_u64(offsets[0], file, where + "'s data_offsets[0]");
  entry.end = header_u64(offsets[1], file, where + "'s data_offsets[1]");
  const auto span = trainloop::detail::concat(where, "'s data_offsets = [", entry.begin, ", ", entry.end, "]");
  if (entry.end < entry.begin) throw safetensors_error(file, "has " + span + ", which end before they begin; expected end >= begin");
  if (entry.end > data_bytes) {
    throw safetensors_error(file, trainloop::detail::concat("has ", span, " outside the data; expected end <= ", data_bytes,
                                                            " (the bytes after the header)"));
  }
  if (entry.end - entry.begin != static_cast<uint64_t>(bytes)) {
    throw safetensors_error(file, trainloop::detail::concat("has ", span, ", ", entry.end - entry.begin, " bytes; expected ",
                                                            bytes, " (", entry.numel(), " elements of ", item, " bytes)"));
  }
  return entry;
}

/// @brief Reads a header's JSON as it is parsed into the entries and the metadata
/// (json_sax_reader.hpp says why not a DOM): one tensor's object at a time is held as JSON and
/// checked by parse_entry() as it closes.
class SafetensorsHeaderReader final : public JsonSaxReader {
 public:
  /// @param data_bytes the bytes after the header
  /// @param file the file, for messages
  SafetensorsHeaderReader(uint64_t data_bytes, const std::string& file) : data_bytes_(data_bytes), file_(file) {}

  /// The entries (in the header's order) and the metadata read.
  SafetensorsHeader take() { return std::move(header_); }

 private:
  /// Where the parser is, outside a held value.
  enum class Place { Top, Root, Metadata, Done };
  /// safetensors writes one key ("format"); a bound keeps the metadata's memory near the header's size.
  static constexpr size_t kMaxMetadataKeys = 65536;

  bool enter_object() override {
    if (place_ == Place::Top) {
      place_ = Place::Root;
      return true;
    }
    if (place_ == Place::Root && key_ == "__metadata__") {
      place_ = Place::Metadata;
      return true;
    }
    return false;  // a tensor's object: held whole, then parse_entry
  }
  void leave_object() override { place_ = place_ == Place::Metadata ? Place::Root : Place::Done; }
  void on_key(std::string key) override { (place_ == Place::Metadata ? metadata_key_ : key_) = std::move(key); }
  void on_string(std::string& value) override {
    if (place_ != Place::Metadata) return on_value(nlohmann::json(std::move(value)));
    if (++metadata_keys_ > kMaxMetadataKeys) {
      throw safetensors_error(file_, trainloop::detail::concat("has more than ", kMaxMetadataKeys,
                                                               " __metadata__ keys; expected a few (safetensors writes \"format\")"));
    }
    header_.metadata[metadata_key_] = std::move(value);
  }
  void on_value(const nlohmann::json& value) override {
    if (place_ == Place::Top) {
      throw safetensors_error(file_, std::string("has a header that is JSON ") + value.type_name() +
                                         "; expected a JSON object of tensors");
    }
    if (place_ == Place::Metadata) {
      throw safetensors_error(file_, "has __metadata__ " + quote_untrusted(metadata_key_) + " = " +
                                         escape_untrusted(value.dump(), 80) + "; expected a string");
    }
    if (key_ == "__metadata__") {
      throw safetensors_error(file_, std::string("has __metadata__ as JSON ") + value.type_name() +
                                         "; expected an object of strings");
    }
    header_.entries.push_back(parse_entry(key_, value, data_bytes_, file_));
  }

  uint64_t data_bytes_;
  const std::string& file_;
  SafetensorsHeader header_;
  Place place_ = Place::Top;
  std::string key_;           // the root's key being read: a tensor's name, or __metadata__
  std::string metadata_key_;  // the metadata's key being read
  size_t metadata_keys_ = 0;
};

}  // namespace detail

/// @brief Parses and checks the JSON header of a safetensors file.
/// @param json the N header bytes (trailing spaces allowed)
/// @param data_bytes how many bytes follow the header in the file
/// @param file the file, for messages
/// @return the entries by data offset, and the metadata
/// @throws trainloop::CheckpointError naming the file and the problem: not JSON, not an object,
///         metadata not strings, an unknown dtype, a bad shape, offsets outside the data, of the
///         wrong size, overlapping, or data that no tensor covers.
inline SafetensorsHeader parse_safetensors_header(std::string_view json, uint64_t data_bytes, const std::string& file) {
  // Nothing deeper than object > entry > shape is valid; bounding depth bounds the walk.
  constexpr int kMaxDepth = 3;
  if (const int depth = json_depth_beyond(json, kMaxDepth)) {  // linear time: nesting_depth.hpp says why
    throw detail::safetensors_error(file, trainloop::detail::concat("has a header nesting JSON ", depth,
                                                                    " levels deep; expected at most ", kMaxDepth));
  }
  detail::SafetensorsHeaderReader reader(data_bytes, file);
  if (!nlohmann::json::sax_parse(json.begin(), json.end(), &reader)) {
    throw detail::safetensors_error(file, "has a header that is not JSON (" + escape_untrusted(reader.parse_failure()) +
                                              "); expected a JSON object of tensors");
  }
  SafetensorsHeader header = reader.take();
  // Each name once (a JSON object may repeat a key; a DOM kept the last silently).
  std::vector<std::string_view> names;
  names.reserve(header.entries.size());
  for (const auto& entry : header.entries) names.push_back(entry.name);
  std::sort(names.begin(), names.end());
  if (const auto twice = std::adjacent_find(names.begin(), names.end()); twice != names.end()) {
    throw detail::safetensors_error(file, "has tensor " + quote_untrusted(*twice) + " twice; expected each name once");
  }
  // The file's order; empty tensors (begin == end) first at their offset.
  std::sort(header.entries.begin(), header.entries.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    return std::tie(a.begin, a.end, a.name) < std::tie(b.begin, b.end, b.name);
  });
  uint64_t covered = 0;  // the data before it is every earlier tensor's, without gaps
  for (size_t i = 0; i < header.entries.size(); ++i) {
    const auto& entry = header.entries[i];
    if (entry.begin > covered) {
      throw detail::safetensors_error(file, trainloop::detail::concat("has a hole: data bytes [", covered, ", ", entry.begin,
                                                                      ") belong to no tensor; expected the data fully indexed"));
    }
    if (entry.begin < covered) {
      throw detail::safetensors_error(
          file, trainloop::detail::concat("has tensor ", quote_untrusted(entry.name), " at data_offsets [", entry.begin, ", ",
                                          entry.end, "], overlapping ", quote_untrusted(header.entries[i - 1].name),
                                          " (up to ", covered, "); expected tensors that do not overlap"));
    }
    covered = entry.end;
  }
  if (covered != data_bytes) {
    throw detail::safetensors_error(file, trainloop::detail::concat("has a hole: data bytes [", covered, ", ", data_bytes,
                                                                    ") belong to no tensor; expected the data fully indexed"));
  }
  return header;
}

/// @brief The header a writer puts before the data: JSON of the entries (in their order, at the
/// offsets given) and the metadata, padded with spaces to a multiple of 8 bytes as safetensors
/// pads it, with the 8-byte length in front.
/// @param entries the tensors, with their offsets set
/// @param metadata `__metadata__` (omitted when empty)
/// @return the bytes that start the file
inline std::string safetensors_header_bytes(const std::vector<SafetensorsEntry>& entries,
                                            const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json document = nlohmann::ordered_json::object();
  if (!metadata.empty()) document["__metadata__"] = metadata;
  for (const auto& entry : entries) {
    document[entry.name] = {{"dtype", safetensors_dtype_name(entry.dtype)},
                            {"shape", entry.shape},
                            {"data_offsets", {entry.begin, entry.end}}};
  }
  std::string json = document.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((uint64_t(json.size()) >> (8 * i)) & 0xff);
  return bytes + json;
}

}  // namespace trainloop::serialization
