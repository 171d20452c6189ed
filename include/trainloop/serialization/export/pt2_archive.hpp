#pragma once
/// @file
/// @brief A PT2 archive (the zip file `torch.export.save` writes), read without trusting it: the
/// zip directory checked first (read_zip_directory), JSON parsed by nlohmann-json with its size
/// and nesting bounded, tensors read as raw bytes whose sizes, strides and offsets are checked
/// against the bytes there are. Nothing in the file is run: no pickle is read (tensor subclasses
/// that torch pickles are refused), and the graph is data for serialization::ExportGraph.
///
/// The layout (PyTorch's "PT2 Archive Spec", torch/export/pt2_archive/constants.py in 2.11):
///
///     <root>/archive_format                          "pt2"
///     <root>/archive_version                         "0"
///     <root>/byteorder                               "little"
///     <root>/models/<model>.json                     the program (export schema, serialization::ExportGraph)
///     <root>/data/weights/<model>_weights_config.json   name -> {path_name, is_param, use_pickle, tensor_meta}
///     <root>/data/weights/weight_<n>                 raw bytes of one storage (shared by tied weights)
///     <root>/data/constants/<model>_constants_config.json, tensor_<n>: the same, for constants
///     <root>/data/sample_inputs/<model>.pt            torch.save'd example inputs (never read here)

#include <trainloop/error.hpp>
#include <trainloop/serialization/bool_bytes.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/archive/zip_directory.hpp>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainloop::serialization {
TRAINLOOP_JSON_REFERENCES_BEGIN  // json_member's references: serialization/export/export_json.hpp

/// @brief Bounds on what a PT2 archive from a stranger may make the reader do.
struct Pt2Limits {
  /// A program's JSON (resnet50's is ~0.5 MB; a large transformer's a few MB).
  uint64_t json_bytes = uint64_t(256) << 20;
  /// JSON nesting: the export schema nests arguments a handful of levels deep.
  int json_depth = 64;
  /// Dimensions of one tensor (libtorch allows 64).
  size_t tensor_dims = 64;
};

namespace detail {

/// The archive's error: the path, what is wrong, what was expected.
inline CheckpointError pt2_error(const std::filesystem::path& path, const std::string& what) {
  return CheckpointError(trainloop::detail::concat(
      "trainloop: ", path.string(), " ", what,
      what.find("expected") == std::string::npos ? "; expected a PT2 archive written by torch.export.save" : ""));
}

}  // namespace detail

/// @brief One tensor of a weights or constants config (its PayloadMeta).
struct Pt2Payload {
  std::string name;       ///< the state_dict name ("layer1.0.bn1.running_mean") or the constant's name
  std::string file;       ///< the storage's record (data/weights/weight_3)
  bool is_param = false;  ///< a Parameter in Python
  bool requires_grad = false;  ///< as it was in Python (a frozen parameter: false)
  torch::Tensor tensor;   ///< the tensor, on the CPU (requires_grad set as in Python)
  std::vector<int64_t> sizes;           ///< its sizes, as the config says
  std::vector<int64_t> strides;         ///< its strides in the file's storage
  int64_t storage_offset = 0;           ///< in elements
  torch::ScalarType dtype = torch::kFloat;  ///< its dtype
};

/// @brief An open PT2 archive; see the file comment.
class Pt2Archive {
 public:
  /// @brief Opens `path` and checks its format records.
  /// @throws trainloop::CheckpointError naming the path for a missing file, a non-zip, a zip that
  ///         fails read_zip_directory()'s checks, or one that is not a PT2 archive version 0 in
  ///         little-endian byte order.
  explicit Pt2Archive(std::filesystem::path path, Pt2Limits limits = {}) : path_(std::move(path)), limits_(limits) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(path_, error)) {
      throw detail::pt2_error(path_, std::filesystem::exists(path_, error) ? "is not a regular file" : "does not exist");
    }
    char magic[4] = {};
    std::ifstream(path_, std::ios::binary).read(magic, sizeof magic);
    if (std::string_view(magic, 4) != std::string_view("PK\x03\x04", 4)) throw detail::pt2_error(path_, "is not a zip archive");
    for (auto& record : read_zip_directory(path_)) {
      const auto slash = record.name.find('/');
      root_ = record.name.substr(0, slash);
      records_.emplace(record.name.substr(slash + 1), std::move(record));
    }
    if (!has("archive_format")) {
      const bool torchscript = has("data.pkl") || has("constants.pkl") || has("code/__torch__.py");
      throw detail::pt2_error(path_, torchscript ? "is a torch.save or TorchScript archive, not a PT2 archive (it has no "
                                                   "archive_format record); expected a file written by torch.export.save "
                                                   "(a TorchScript file loads with interop::ScriptModule)"
                                                 : "has no archive_format record, so it is no PT2 archive");
    }
    const std::string format = read("archive_format", 64);
    if (format != "pt2") {
      throw detail::pt2_error(path_, trainloop::detail::concat("has archive_format ", quote_untrusted(format),
                                                               "; expected \"pt2\" (torch.export.save)"));
    }
    if (has("archive_version")) {
      const std::string version = read("archive_version", 64);
      if (version != "0") {
        throw detail::pt2_error(path_, trainloop::detail::concat("has archive_version ", quote_untrusted(version),
                                                                 "; expected \"0\", the version torch 2.11 writes"));
      }
    }
    if (has("byteorder")) {
      const std::string order = read("byteorder", 64);
      if (order != "little") {
        throw detail::pt2_error(path_, trainloop::detail::concat("has byteorder ", quote_untrusted(order),
                                                                 "; expected \"little\" (this machine's)"));
      }
    }
    const std::string prefix = "models/", suffix = ".json";
    for (const auto& [name, record] : records_) {
      if (name.size() > prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
          name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
          name.find('/', prefix.size()) == std::string::npos) {
        programs_.push_back(name.substr(prefix.size(), name.size() - prefix.size() - suffix.size()));
      }
    }
    if (programs_.empty()) throw detail::pt2_error(path_, "holds no program (no models/<name>.json record)");
  }

  /// The file.
  const std::filesystem::path& path() const { return path_; }
  /// The archive's top folder (the file's stem when torch.export.save wrote it).
  const std::string& root() const { return root_; }
  /// The programs it holds, by name ("model" for one written by torch.export.save).
  const std::vector<std::string>& programs() const { return programs_; }
  /// True when it has record `name` (without the top folder).
  bool has(const std::string& name) const { return records_.count(name) != 0; }
  /// Every record (without the top folder), for a writer that copies the archive.
  const std::map<std::string, ZipRecord>& records() const { return records_; }

  /// @brief The bytes of record `name`, at most `max_bytes` of them.
  /// @throws trainloop::CheckpointError naming it when it is missing, compressed or larger.
  std::string read(const std::string& name, uint64_t max_bytes) const {
    const auto found = records_.find(name);
    if (found == records_.end()) {
      throw detail::pt2_error(path_, trainloop::detail::concat("has no record ", quote_untrusted(name),
                                                               ", which its program needs"));
    }
    return read_stored_record(path_, found->second, max_bytes);
  }

  /// @brief Record `name` parsed as JSON within the limits.
  nlohmann::json read_json(const std::string& name) const {
    return parse_untrusted_json(read(name, limits_.json_bytes), path_.string() + "'s " + quote_untrusted(name), limits_.json_depth);
  }

  /// @brief The tensors a weights or constants config describes (`config_name` is
  /// "data/weights/model_weights_config.json"; its files are in `directory`, "data/weights/").
  /// A missing config is an empty one. Tensors sharing a file share a storage, as they did in Python.
  /// @throws trainloop::CheckpointError naming the entry for a pickled tensor, a missing file, a
  ///         dtype, layout, size, stride or offset that does not fit the file's bytes.
  std::vector<Pt2Payload> read_payloads(const std::string& config_name, const std::string& directory) const {
    std::vector<Pt2Payload> payloads;
    if (!has(config_name)) return payloads;
    const nlohmann::json document = read_json(config_name);
    const auto& config = json_member(document, "config", path_.string() + "'s " + quote_untrusted(config_name));
    if (!config.is_object()) throw detail::pt2_error(path_, quote_untrusted(config_name) + "'s config is not a JSON object");
    std::map<std::string, torch::Tensor> storages;  // file -> its bytes, read once
    for (const auto& [name, entry] : config.items()) {
      const std::string where = path_.string() + "'s " + quote_untrusted(config_name) + " entry " + quote_untrusted(name);
      if (entry.contains("use_pickle") && entry["use_pickle"].is_boolean() && entry["use_pickle"].get<bool>()) {
        throw CheckpointError(trainloop::detail::concat(
            "trainloop: ", where, " is a pickled tensor (a tensor subclass torch.save wrote); expected plain tensors "
            "stored as raw bytes (trainloop reads no pickle from a PT2 archive)"));
      }
      Pt2Payload payload;
      payload.name = name;
      const std::string& file = json_string(json_member(entry, "path_name", where), where + " path_name");
      if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos || file == "..") {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " names the file ", quote_untrusted(file),
                                                        "; expected a plain file name in ", directory));
      }
      payload.file = directory + file;
      if (entry.contains("is_param") && entry["is_param"].is_boolean()) payload.is_param = entry["is_param"].get<bool>();
      auto& storage = storages[payload.file];
      if (!storage.defined()) {
        if (!has(payload.file)) {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " names the file ", quote_untrusted(payload.file),
                                                          ", which the archive does not have; expected every file its ",
                                                          "weights config names"));
        }
        const std::string bytes = read(payload.file, records_.at(payload.file).size);
        storage = torch::empty({static_cast<int64_t>(bytes.size())}, torch::kUInt8);
        if (!bytes.empty()) std::memcpy(storage.data_ptr(), bytes.data(), bytes.size());
      }
      const auto& meta = json_member(entry, "tensor_meta", where);
      payload.tensor = view_of(storage, meta, where);
      payload.sizes = payload.tensor.sizes().vec();
      payload.strides = payload.tensor.strides().vec();
      payload.storage_offset = payload.tensor.storage_offset();
      payload.dtype = payload.tensor.scalar_type();
      payload.requires_grad = meta.contains("requires_grad") && meta["requires_grad"].is_boolean() &&
                              meta["requires_grad"].get<bool>() && payload.tensor.is_floating_point();
      payloads.push_back(std::move(payload));
    }
    // A storage that holds one tensor gives it its own, compact storage (so no parameter is a view);
    // tensors sharing one stay views of it, tied as in Python.
    std::map<std::string, int> users;
    for (const auto& payload : payloads) ++users[payload.file];
    for (auto& payload : payloads) {
      if (users[payload.file] == 1) payload.tensor = payload.tensor.clone(at::MemoryFormat::Preserve);
      payload.tensor = payload.tensor.detach().requires_grad_(payload.requires_grad);
    }
    return payloads;
  }

  /// @brief Checks a TensorMeta's sizes, strides and offset against `bytes` bytes of storage:
  /// every size, stride and the offset >= 0, the sizes' product within 64 bits (torch makes strides
  /// of it), no two elements on one place (a parameter with overlapping elements cannot be
  /// updated in place, and a stride 0 over a large size would make a clone of any size from four
  /// bytes), and the last element inside the bytes.
  /// @return the number of elements of `item_size` bytes the view spans (0 for an empty tensor)
  /// @throws trainloop::CheckpointError naming `where` when they do not fit.
  static int64_t checked_extent(const std::vector<int64_t>& sizes, const std::vector<int64_t>& strides, int64_t offset,
                                int64_t item_size, uint64_t bytes, const std::string& where) {
    using trainloop::detail::concat;
    auto fail = [&](const std::string& what) { return CheckpointError(concat("trainloop: ", where, " ", what)); };
    if (offset < 0) throw fail(concat("has storage offset ", offset, "; expected >= 0"));
    int64_t product = 1;  // of the sizes, zeros counted as ones: what torch computes contiguous strides from
    bool empty = false;
    std::vector<std::pair<int64_t, int64_t>> spread;  // (stride, size) of the dimensions of size > 1
    for (size_t d = 0; d < sizes.size(); ++d) {
      if (sizes[d] < 0 || strides[d] < 0) {
        throw fail(concat("has size ", sizes[d], " and stride ", strides[d], " in dimension ", d, "; expected both >= 0"));
      }
      if (__builtin_mul_overflow(product, std::max<int64_t>(sizes[d], 1), &product)) {
        throw fail("has sizes whose product overflows 64 bits; expected a tensor inside its file");
      }
      empty = empty || sizes[d] == 0;
      if (sizes[d] > 1) spread.emplace_back(strides[d], sizes[d]);
    }
    if (empty) return 0;
    std::sort(spread.begin(), spread.end());
    int64_t extent = 0;  // the farthest element the dimensions so far reach, in elements from the first
    for (const auto& [stride, size] : spread) {
      if (stride <= extent) {
        throw fail(concat("has a dimension of size ", size, " with stride ", stride, ", which puts two elements on one ",
                          "place; expected a tensor whose elements do not overlap"));
      }
      int64_t step = 0;
      if (__builtin_mul_overflow(size - 1, stride, &step) || __builtin_add_overflow(extent, step, &extent)) {
        throw fail("has sizes and strides whose extent overflows 64 bits; expected a tensor inside its file");
      }
    }
    int64_t last = 0, end_bytes = 0;
    if (__builtin_add_overflow(offset, extent, &last) || __builtin_add_overflow(last, int64_t{1}, &last) ||
        __builtin_mul_overflow(last, item_size, &end_bytes) || static_cast<uint64_t>(end_bytes) > bytes) {
      throw fail(concat("reads elements up to ", last, " of ", item_size, " bytes; its file has ", bytes,
                        " bytes; expected the tensor inside its file"));
    }
    return last;
  }

 private:
  /// The tensor a TensorMeta describes, a view of `storage` (bytes), after checking it fits.
  torch::Tensor view_of(const torch::Tensor& storage, const nlohmann::json& meta, const std::string& where) const {
    const auto dtype = export_scalar_type(json_int(json_member(meta, "dtype", where), where + " dtype"), where);
    if (meta.contains("layout") && meta["layout"].is_number_integer() && meta["layout"].get<int64_t>() != 7) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has layout ", meta["layout"].get<int64_t>(),
                                                      "; expected 7 (strided): sparse and mkldnn tensors are not read"));
    }
    auto ints = [&](const char* key) {
      const auto& list = json_member(meta, key, where);
      if (!list.is_array() || list.size() > limits_.tensor_dims) {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " ", key, " is not a list of at most ",
                                                        limits_.tensor_dims, " dimensions"));
      }
      std::vector<int64_t> out;
      for (const auto& item : list) {
        auto [kind, value] = json_union(item, where + " " + key);
        if (kind != "as_int") {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " ", key, " has a ", quote_untrusted(kind),
                                                          "; expected concrete sizes (as_int) for a stored tensor"));
        }
        out.push_back(json_int(*value, where + " " + key));
      }
      return out;
    };
    const auto sizes = ints("sizes"), strides = ints("strides");
    if (sizes.size() != strides.size()) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has ", sizes.size(), " sizes and ",
                                                      strides.size(), " strides; expected as many of each"));
    }
    int64_t offset = 0;
    if (meta.contains("storage_offset")) {
      auto [kind, value] = json_union(meta["storage_offset"], where + " storage_offset");
      if (kind != "as_int") throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " storage_offset is ", quote_untrusted(kind), "; expected as_int"));
      offset = json_int(*value, where + " storage_offset");
    }
    const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
    const int64_t elements = checked_extent(sizes, strides, offset, item, static_cast<uint64_t>(storage.numel()), where);
    if (dtype == torch::kBool) {
      // Every byte of the storage, not only those the view reaches: another view may reach others.
      const auto bad = first_invalid_bool_byte(storage.data_ptr(), static_cast<std::size_t>(storage.numel()));
      if (bad != static_cast<std::size_t>(storage.numel())) {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is a BOOL tensor whose storage holds byte ",
                                                        int(static_cast<const unsigned char*>(storage.data_ptr())[bad]),
                                                        " at element ", bad, "; expected 0 or 1"));
      }
    }
    if (elements == 0) return torch::empty(sizes, torch::TensorOptions().dtype(dtype));
    // The file's bytes as `elements` items of dtype (a copy when the bytes are not a whole number
    // of items, which only a file that is not torch's has), then the view.
    torch::Tensor flat;
    if (storage.numel() % item == 0 && reinterpret_cast<uintptr_t>(storage.data_ptr()) % item == 0) {
      flat = storage.view(dtype);
    } else {
      flat = torch::empty({elements}, torch::TensorOptions().dtype(dtype));
      std::memcpy(flat.data_ptr(), storage.data_ptr(), static_cast<size_t>(elements * item));
    }
    return flat.as_strided(sizes, strides, offset);
  }

  std::filesystem::path path_;
  Pt2Limits limits_;
  std::string root_;
  std::map<std::string, ZipRecord> records_;
  std::vector<std::string> programs_;
};

TRAINLOOP_JSON_REFERENCES_END
}  // namespace trainloop::serialization
