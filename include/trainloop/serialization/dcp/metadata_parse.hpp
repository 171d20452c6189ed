#pragma once
/// @file
/// @brief A DCP `.metadata` pickle read into a dcp::Metadata with the safe unpickler
/// (serialization/pickle/pickle_reader.hpp, PickleFlavor::DcpMetadata): only DCP's own classes and the
/// torch and pathlib names their fields pickle to may be named (pickle_globals.hpp), none of them
/// runs, memory is bounded by PickleLimits. Python's own reader, torch 2.11's
/// FileSystemReader.read_metadata, pickle.loads the file, which would run any global it names.
///
/// Read: Metadata's state_dict_metadata (tensors: dtype, requires_grad, size, chunks; bytes
/// entries), storage_data (every chunk's and bytes entry's file, offset and length, matched by
/// fqn and offsets) and planner_data; storage_meta and version are not needed to read the items.

#include <trainloop/error.hpp>
#include <trainloop/serialization/dcp/metadata.hpp>
#include <trainloop/serialization/pickle/pickle_reader.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace trainloop::serialization::dcp {

namespace detail {

/// Walks a PickleDocument of DCP's metadata, naming `source` in every error.
class MetadataWalker {
 public:
  using Kind = PickleValue::Kind;
  MetadataWalker(const PickleDocument& document, std::string source) : document_(document), source_(std::move(source)) {}

  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    throw CheckpointError(trainloop::detail::concat("trainloop: the DCP metadata ", source_, " ", std::forward<Parts>(parts)...));
  }
  /// The state of an object of DCP's class `name` ("Metadata", "filesystem._StorageInfo").
  const PickleValue& state_of(const PickleValue& value, std::string_view name, const char* what) const {
    const std::string expected = name.find('.') == std::string_view::npos
                                     ? std::string("torch.distributed.checkpoint.metadata.") + std::string(name)
                                     : std::string("torch.distributed.checkpoint.") + std::string(name);
    if (value.kind != Kind::Object || document_.text(document_.items(value)[0]) != expected) {
      fail("has ", what, " that is ", value.kind == Kind::Object ? quote_untrusted(document_.text(document_.items(value)[0])) : a_kind(value.kind),
           "; expected a ", expected);
    }
    return document_.items(value)[1];
  }
  /// The value of `key` in a dict state, or nullptr.
  const PickleValue* field(const PickleValue& dict, std::string_view key) const {
    if (dict.kind != Kind::Dict) return nullptr;
    const auto& items = document_.items(dict);
    for (size_t i = 0; i + 1 < items.size(); i += 2) {
      if (items[i].kind == Kind::String && document_.text(items[i]) == key) return &items[i + 1];
    }
    return nullptr;
  }
  const PickleValue& required(const PickleValue& dict, std::string_view key, const char* what) const {
    if (dict.kind != Kind::Dict) fail("has ", what, " whose state is ", a_kind(dict.kind), "; expected a dict");
    const auto* found = field(dict, key);
    if (found == nullptr) fail("has ", what, " without ", key, "; expected the field");
    return *found;
  }
  const std::string& text(const PickleValue& value, const char* what) const {
    if (value.kind != Kind::String) fail("has ", what, " that is ", a_kind(value.kind), "; expected a str");
    return document_.text(value);
  }
  int64_t integer(const PickleValue& value, const char* what) const {
    if (value.kind != Kind::Int) fail("has ", what, " that is ", a_kind(value.kind), "; expected an int");
    return value.integer;
  }
  std::vector<int64_t> ints(const PickleValue& value, const char* what) const {
    if (value.kind != Kind::Tuple && value.kind != Kind::List) fail("has ", what, " that is ", a_kind(value.kind), "; expected a torch.Size");
    std::vector<int64_t> out;
    for (const auto& item : document_.items(value)) out.push_back(integer(item, what));
    return out;
  }
  const std::vector<PickleValue>& items(const PickleValue& value, Kind kind, const char* what) const {
    if (value.kind != kind) fail("has ", what, " that is ", a_kind(value.kind), "; expected ", a_kind(kind));
    return document_.items(value);
  }
  const PickleDocument& document() const { return document_; }

 private:
  const PickleDocument& document_;
  std::string source_;
};

/// A file name of the checkpoint's directory, never a path out of it.
inline bool plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace detail

/// @brief Parses a DCP `.metadata` pickle (Python's, or metadata_pickle's) into a Metadata.
/// @param pickle the file's bytes
/// @param source names it in errors (the file's path)
/// @throws trainloop::CheckpointError naming `source`: a global not on the allow-list (os.system,
///         builtins.eval...), a pickle that is not DCP's Metadata, a chunk without its storage,
///         chunks outside their tensor, overlapping, or (complete) leaving elements out, an item
///         whose file is not a plain name in the directory, stream transforms (compression), a
///         dtype it cannot name.
/// @param complete false for one rank's part (metadata_pickle of DistcpWriter::finish, shipped to
///        rank 0 to merge), whose chunks cover only that rank's share: coverage is then
///        merge_metadata's to check (inside the tensor and no overlaps are checked either way)
inline Metadata parse_metadata(std::string_view pickle, const std::string& source, bool complete = true) {
  using Kind = PickleValue::Kind;
  PickleDocument document;
  try {
    auto no_storages = [](const std::string&, torch::ScalarType, int64_t) -> torch::Tensor {
      pickle_fail("a persistent id; expected none in DCP metadata");
    };
    document = Unpickler(pickle, PickleFlavor::DcpMetadata, no_storages).run();
  } catch (const PickleError& error) {
    throw CheckpointError(trainloop::detail::concat("trainloop: the DCP metadata ", source, " is not a pickle of DCP's Metadata (",
                                                    error.what(), "); expected the .metadata torch.distributed.checkpoint writes"));
  }
  const detail::MetadataWalker walk(document, source);
  const auto& root = walk.state_of(document.root, "Metadata", "a root");
  Metadata out;
  // state_dict_metadata: fqn -> TensorStorageMetadata | BytesStorageMetadata.
  const auto& entries = walk.items(walk.required(root, "state_dict_metadata", "Metadata"), Kind::Dict, "state_dict_metadata");
  for (size_t i = 0; i + 1 < entries.size(); i += 2) {
    const std::string& fqn = walk.text(entries[i], "a state_dict_metadata key");
    const auto& value = entries[i + 1];
    if (value.kind == Kind::Object && document.text(document.items(value)[0]) == "torch.distributed.checkpoint.metadata.BytesStorageMetadata") {
      out.bytes[fqn].fqn = fqn;
      continue;
    }
    const auto& state = walk.state_of(value, "TensorStorageMetadata", "a state_dict_metadata value");
    TensorEntry entry;
    entry.fqn = fqn;
    const auto& properties = walk.state_of(walk.required(state, "properties", "TensorStorageMetadata"), "TensorProperties", "properties");
    // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory),
    // and from torch 2.15 on a sixth, the saved tensor's strides (None or ints): they describe its
    // memory layout, not its values, so they are checked and not used.
    const auto& fields = walk.items(properties, Kind::Tuple, "TensorProperties' state");
    if (fields.size() != 5 && fields.size() != 6) {
      walk.fail("has a TensorProperties state of ", fields.size(), " fields; expected 5 (torch 2.11) or 6 (2.15: with strides)");
    }
    if (fields.size() == 6 && fields[5].kind != Kind::None) walk.ints(fields[5], "TensorProperties' strides");
    if (fields[0].kind != Kind::Global || document.text(fields[0]).rfind("torch.", 0) != 0 ||
        !dtype_from_name(std::string_view(document.text(fields[0])).substr(6), entry.dtype)) {
      walk.fail("gives ", escape_untrusted(fqn), " the dtype ", fields[0].kind == Kind::Global ? quote_untrusted(document.text(fields[0])) : a_kind(fields[0].kind),
                "; expected torch.float32, float64, float16, bfloat16, int8-64, uint8, bool or complex64/128");
    }
    if (fields[1].kind != Kind::String || document.text(fields[1]) != "torch.strided") {
      walk.fail("gives ", escape_untrusted(fqn), " a layout other than torch.strided; expected dense tensors");
    }
    if (fields[2].kind != Kind::Bool) walk.fail("gives ", escape_untrusted(fqn), " a requires_grad of ", a_kind(fields[2].kind), "; expected a bool");
    entry.requires_grad = fields[2].integer != 0;
    entry.size = walk.ints(walk.required(state, "size", "TensorStorageMetadata"), "a size");
    for (const auto& chunk_value : walk.items(walk.required(state, "chunks", "TensorStorageMetadata"), Kind::List, "chunks")) {
      const auto& chunk_state = walk.state_of(chunk_value, "ChunkStorageMetadata", "a chunk");
      StoredChunk chunk;
      chunk.offsets = walk.ints(walk.required(chunk_state, "offsets", "ChunkStorageMetadata"), "a chunk's offsets");
      chunk.sizes = walk.ints(walk.required(chunk_state, "sizes", "ChunkStorageMetadata"), "a chunk's sizes");
      entry.chunks.push_back(std::move(chunk));
    }
    check_chunks_cover(entry, source, /*whole=*/complete);  // inside, no overlaps; covering all when complete
    if (out.bytes.count(fqn) || !out.tensors.emplace(fqn, std::move(entry)).second) walk.fail("names ", escape_untrusted(fqn), " twice; expected each key once");
  }
  // storage_data: MetadataIndex(fqn, offset) -> _StorageInfo(relative_path, offset, length).
  std::map<std::pair<std::string, std::vector<int64_t>>, StoredChunk> stored;  // (fqn, offsets) -> where
  std::map<std::string, BytesEntry> stored_bytes;
  const auto& storage = walk.items(walk.required(root, "storage_data", "Metadata"), Kind::Dict, "storage_data");
  for (size_t i = 0; i + 1 < storage.size(); i += 2) {
    const auto& index = walk.state_of(storage[i], "MetadataIndex", "a storage_data key");
    const auto& info = walk.state_of(storage[i + 1], "filesystem._StorageInfo", "a storage_data value");
    const std::string& fqn = walk.text(walk.required(index, "fqn", "MetadataIndex"), "a MetadataIndex fqn");
    StoredChunk where;
    where.relative_path = walk.text(walk.required(info, "relative_path", "_StorageInfo"), "a relative_path");
    where.offset = walk.integer(walk.required(info, "offset", "_StorageInfo"), "an item offset");
    where.length = walk.integer(walk.required(info, "length", "_StorageInfo"), "an item length");
    if (!detail::plain_file_name(where.relative_path)) {
      walk.fail("puts ", escape_untrusted(fqn), " in ", quote_untrusted(where.relative_path), "; expected a file name in the checkpoint's directory");
    }
    if (where.offset < 0 || where.length < 0) walk.fail("puts ", escape_untrusted(fqn), " at offset ", where.offset, " length ", where.length, "; expected both >= 0");
    if (const auto* transforms = walk.field(info, "transform_descriptors");
        transforms != nullptr && transforms->kind != Kind::None && !(transforms->is_container() && document.items(*transforms).empty())) {
      walk.fail("stores ", escape_untrusted(fqn), " through stream transforms (FileSystemWriter's _extensions); expected items written plainly");
    }
    const auto* offset = walk.field(index, "offset");
    if (offset == nullptr || offset->kind == Kind::None) {
      stored_bytes[fqn] = BytesEntry{fqn, where.relative_path, where.offset, where.length};
    } else {
      stored[{fqn, walk.ints(*offset, "a MetadataIndex offset")}] = std::move(where);
    }
  }
  for (auto& [fqn, entry] : out.tensors) {
    for (auto& chunk : entry.chunks) {
      const auto found = stored.find({fqn, chunk.offsets});
      if (found == stored.end()) walk.fail("has no storage_data for the chunk of ", escape_untrusted(fqn), " at ", c10::IntArrayRef(chunk.offsets), "; expected one per chunk");
      chunk.relative_path = found->second.relative_path;
      chunk.offset = found->second.offset;
      chunk.length = found->second.length;
    }
  }
  for (auto& [fqn, entry] : out.bytes) {
    const auto found = stored_bytes.find(fqn);
    if (found == stored_bytes.end()) walk.fail("has no storage_data for the bytes value ", escape_untrusted(fqn), "; expected one");
    entry = found->second;
  }
  // planner_data (Any to DCP): fqn -> a tuple of strs and ints, when it is that.
  if (const auto* planner = walk.field(root, "planner_data"); planner != nullptr && planner->kind == Kind::Dict) {
    const auto& pairs = document.items(*planner);
    for (size_t i = 0; i + 1 < pairs.size(); i += 2) {
      if (pairs[i].kind != Kind::String || (pairs[i + 1].kind != Kind::Tuple && pairs[i + 1].kind != Kind::List)) continue;
      std::vector<std::string> path;
      std::vector<size_t> ints;
      for (const auto& element : document.items(pairs[i + 1])) {
        if (element.kind == Kind::Int) {
          ints.push_back(path.size());
          path.push_back(std::to_string(element.integer));
        } else if (element.kind == Kind::String) {
          path.push_back(document.text(element));
        }
      }
      const std::string& fqn = document.text(pairs[i]);
      out.planner_data[fqn] = std::move(path);
      if (!ints.empty()) out.planner_int_elements[fqn] = std::move(ints);
    }
  }
  return out;
}

}  // namespace trainloop::serialization::dcp
