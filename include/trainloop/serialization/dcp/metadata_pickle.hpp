#pragma once
/// @file
/// @brief The `.metadata` pickle that Python's DCP reads as its `Metadata`, written from a
/// dcp::Metadata: what torch 2.11's FileSystemWriter.finish pickle.dumps, and its
/// FileSystemReader.read_metadata pickle.loads (a plain pickle, so every class is named).
///
/// The objects, as 2.11 pickles them (dataclasses: NEWOBJ of the class, BUILD of its `__dict__`):
/// - Metadata{state_dict_metadata: {fqn: TensorStorageMetadata | BytesStorageMetadata},
///   planner_data: {fqn: (nested path...)}, storage_data: {MetadataIndex: _StorageInfo},
///   storage_meta: StorageMeta, version: "1.0.0"};
/// - TensorStorageMetadata{properties: TensorProperties, size: torch.Size, chunks: [ChunkStorageMetadata{offsets, sizes}]};
///   TensorProperties' state is its `__getstate__` tuple (dtype, layout, requires_grad,
///   _MEM_FORMAT_ENCODING member, pin_memory); a torch.Size is `torch.Size((ints))`; a layout
///   `torch.serialization._get_layout("torch.strided")`; a dtype the global `torch.float32`;
/// - MetadataIndex{fqn, offset (a tensor chunk's offsets; absent for bytes), index} ->
///   _StorageInfo{relative_path, offset, length} (torch.distributed.checkpoint.filesystem).
/// Written with protocol 2 opcodes and no memo, which every Python 3 unpickler reads.

#include <trainloop/error.hpp>
#include <trainloop/serialization/dcp/metadata.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace trainloop::serialization::dcp {

namespace detail {

/// The opcodes metadata_pickle() writes, appended to one string.
class PickleWriter {
 public:
  PickleWriter() { out_ += "\x80\x02"; }  // PROTO 2
  std::string finish() {
    out_ += '.';  // STOP
    return std::move(out_);
  }
  void global(std::string_view module, std::string_view name) {
    out_ += 'c';
    out_.append(module).append("\n").append(name).append("\n");
  }
  void text(std::string_view value) {
    out_ += 'X';  // BINUNICODE: 4-byte length
    const auto length = static_cast<uint32_t>(value.size());
    append_le(length, 4);
    out_.append(value);
  }
  void integer(int64_t value) {
    if (value >= INT32_MIN && value <= INT32_MAX) {
      out_ += 'J';  // BININT
      append_le(static_cast<uint64_t>(static_cast<int32_t>(value)), 4);
    } else {
      out_ += "\x8a\x08";  // LONG1 of 8 bytes, two's complement
      append_le(static_cast<uint64_t>(value), 8);
    }
  }
  void boolean(bool value) { out_ += value ? '\x88' : '\x89'; }
  void none() { out_ += 'N'; }
  void mark() { out_ += '('; }
  void tuple() { out_ += 't'; }         // TUPLE of the values since the MARK
  void empty_dict() { out_ += '}'; }
  void set_items() { out_ += 'u'; }     // SETITEMS of the pairs since the MARK
  void empty_list() { out_ += ']'; }
  void appends() { out_ += 'e'; }       // APPENDS of the values since the MARK
  void reduce() { out_ += 'R'; }
  void build() { out_ += 'b'; }
  /// `cls.__new__(cls)` of a DCP class (NEWOBJ of an empty tuple); its state follows, then build().
  void new_object(std::string_view module, std::string_view name) {
    global(module, name);
    out_ += ")\x81";
  }
  void ints_tuple(const std::vector<int64_t>& values) {
    mark();
    for (const int64_t value : values) integer(value);
    tuple();
  }
  /// `torch.Size(values)`.
  void size(const std::vector<int64_t>& values) {
    global("torch", "Size");
    mark();
    ints_tuple(values);
    tuple();
    reduce();
  }

 private:
  void append_le(uint64_t value, int bytes) {
    for (int i = 0; i < bytes; ++i) out_ += static_cast<char>((value >> (8 * i)) & 0xff);
  }
  std::string out_;
};

inline constexpr std::string_view kMetadataModule = "torch.distributed.checkpoint.metadata";

}  // namespace detail

/// @brief The pickle Python's DCP reads as its Metadata (see the file comment); also how a rank's
/// part travels to rank 0 as bytes (parse_metadata reads it back).
/// @throws trainloop::CheckpointError for a dtype Python's DCP metadata cannot name here.
inline std::string metadata_pickle(const Metadata& metadata) {
  using detail::kMetadataModule;
  detail::PickleWriter w;
  w.new_object(kMetadataModule, "Metadata");
  w.empty_dict();
  w.mark();
  w.text("state_dict_metadata");
  w.empty_dict();
  w.mark();
  for (const auto& [fqn, entry] : metadata.tensors) {
    const auto dtype = dtype_name(entry.dtype);
    if (dtype.empty()) {
      throw CheckpointError(trainloop::detail::concat("trainloop: the DCP tensor ", fqn, " has the dtype ", entry.dtype,
                                                      "; expected one of float32/64, float16, bfloat16, int8-64, uint8, bool, complex64/128"));
    }
    w.text(fqn);
    w.new_object(kMetadataModule, "TensorStorageMetadata");
    w.empty_dict();
    w.mark();
    w.text("properties");
    w.new_object(kMetadataModule, "TensorProperties");
    w.mark();  // TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    w.global("torch", dtype);
    w.global("torch.serialization", "_get_layout");
    w.mark();
    w.text("torch.strided");
    w.tuple();
    w.reduce();
    w.boolean(entry.requires_grad);
    w.global(kMetadataModule, "_MEM_FORMAT_ENCODING");  // _MEM_FORMAT_ENCODING(0): TORCH_CONTIGUOUS_FORMAT
    w.mark();
    w.integer(0);
    w.tuple();
    w.reduce();
    w.boolean(false);
    w.tuple();
    w.build();
    w.text("size");
    w.size(entry.size);
    w.text("chunks");
    w.empty_list();
    w.mark();
    for (const auto& chunk : entry.chunks) {
      w.new_object(kMetadataModule, "ChunkStorageMetadata");
      w.empty_dict();
      w.mark();
      w.text("offsets");
      w.size(chunk.offsets);
      w.text("sizes");
      w.size(chunk.sizes);
      w.set_items();
      w.build();
    }
    w.appends();
    w.set_items();
    w.build();
  }
  for (const auto& [fqn, entry] : metadata.bytes) {
    w.text(fqn);
    w.new_object(kMetadataModule, "BytesStorageMetadata");  // no state: an empty dataclass
  }
  w.set_items();
  // planner_data: every key's nested path; a key without one is its own path (a top-level value).
  w.text("planner_data");
  w.empty_dict();
  w.mark();
  auto planner_path = [&](const std::string& fqn) {
    w.text(fqn);
    w.mark();
    const auto path = metadata.planner_data.find(fqn);
    if (path == metadata.planner_data.end()) {
      w.text(fqn);
    } else {
      const auto ints = metadata.planner_int_elements.find(fqn);
      for (size_t i = 0; i < path->second.size(); ++i) {
        const bool is_int = ints != metadata.planner_int_elements.end() &&
                            std::find(ints->second.begin(), ints->second.end(), i) != ints->second.end();
        if (is_int) {
          int64_t index = 0;
          try {
            index = std::stoll(path->second[i]);
          } catch (const std::exception&) {
            throw CheckpointError(trainloop::detail::concat("trainloop: the DCP planner path of ", fqn, " has \"", path->second[i],
                                                            "\" at ", i, ", marked an int; expected a decimal list index"));
          }
          w.integer(index);
        } else {
          w.text(path->second[i]);
        }
      }
    }
    w.tuple();
  };
  for (const auto& [fqn, entry] : metadata.tensors) planner_path(fqn);
  for (const auto& [fqn, entry] : metadata.bytes) planner_path(fqn);
  w.set_items();
  // storage_data: MetadataIndex -> _StorageInfo; a MetadataIndex is built before it is a key,
  // since its hash is its fqn and offset.
  w.text("storage_data");
  w.empty_dict();
  w.mark();
  auto storage_info = [&](const std::string& relative_path, int64_t offset, int64_t length) {
    w.new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
    w.empty_dict();
    w.mark();
    w.text("relative_path");
    w.text(relative_path);
    w.text("offset");
    w.integer(offset);
    w.text("length");
    w.integer(length);
    w.set_items();
    w.build();
  };
  for (const auto& [fqn, entry] : metadata.tensors) {
    for (size_t index = 0; index < entry.chunks.size(); ++index) {
      const auto& chunk = entry.chunks[index];
      w.new_object(kMetadataModule, "MetadataIndex");
      w.empty_dict();
      w.mark();
      w.text("fqn");
      w.text(fqn);
      w.text("index");
      w.integer(static_cast<int64_t>(index));
      w.text("offset");
      w.size(chunk.offsets);
      w.set_items();
      w.build();
      storage_info(chunk.relative_path, chunk.offset, chunk.length);
    }
  }
  for (const auto& [fqn, entry] : metadata.bytes) {
    w.new_object(kMetadataModule, "MetadataIndex");
    w.empty_dict();
    w.mark();
    w.text("fqn");
    w.text(fqn);
    w.text("index");
    w.none();
    w.set_items();
    w.build();
    storage_info(entry.relative_path, entry.offset, entry.length);
  }
  w.set_items();
  // storage_meta: StorageMeta() (Python's reader sets its load_id); version: 2.11's CURRENT_DCP_VERSION.
  w.text("storage_meta");
  w.new_object(kMetadataModule, "StorageMeta");
  w.empty_dict();
  w.mark();
  w.text("checkpoint_id");
  w.none();
  w.text("save_id");
  w.none();
  w.text("load_id");
  w.none();
  w.text("modules");
  w.empty_list();
  w.set_items();
  w.build();
  w.text("version");
  w.text("1.0.0");
  w.set_items();
  w.build();
  return w.finish();
}

}  // namespace trainloop::serialization::dcp
