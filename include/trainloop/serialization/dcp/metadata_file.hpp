#pragma once
/// @file
/// @brief A DCP directory's `.metadata` file: written atomically and durably (a temporary file,
/// fsync, rename, fsync of the directory: detail/atomic_file.hpp), and read with every file it
/// names checked to exist and to hold every item's byte range.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/serialization/dcp/metadata.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/dcp/metadata_parse.hpp>
#include <trainloop/serialization/dcp/metadata_pickle.hpp>
#include <trainloop/serialization/pickle/pickle_limits.hpp>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <system_error>

namespace trainloop::serialization::dcp {

/// The name of the metadata file in a DCP directory (2.11's `_metadata_fn`).
inline constexpr const char* kMetadataFileName = ".metadata";

/// @brief Writes directory/".metadata" (metadata_pickle of `metadata`) atomically and durably.
/// @throws trainloop::CheckpointError naming the file and the system's reason when writing fails.
inline void write_metadata(const std::filesystem::path& directory, const Metadata& metadata) {
  trainloop::detail::BasicAtomicFile<CheckpointError> file(directory / kMetadataFileName, "the DCP metadata file");
  file.write(metadata_pickle(metadata));
  file.commit();
}

/// @brief Checks that every file `metadata` names is a regular file of `directory` and that
/// every item's byte range lies inside it.
/// @throws trainloop::CheckpointError naming the file and the item.
inline void check_items_in_files(const std::filesystem::path& directory, const Metadata& metadata) {
  using trainloop::detail::concat;
  std::map<std::string, uint64_t> sizes;  // relative path -> bytes
  auto check = [&](const std::string& fqn, const std::string& relative_path, int64_t offset, int64_t length) {
    auto found = sizes.find(relative_path);
    if (found == sizes.end()) {
      const auto path = directory / relative_path;
      std::error_code error;
      if (!std::filesystem::is_regular_file(path, error)) {
        throw CheckpointError(concat("trainloop: the DCP data file ", untrusted_file_path(path), ", which ", (directory / kMetadataFileName).string(),
                                     " names for ", escape_untrusted(fqn), ", does not exist; expected every file of the checkpoint"));
      }
      const auto size = std::filesystem::file_size(path, error);
      if (error) throw CheckpointError(concat("trainloop: cannot read the size of ", untrusted_file_path(path), " (", error.message(), "); expected a readable file"));
      found = sizes.emplace(relative_path, size).first;
    }
    if (offset < 0 || length < 0 || static_cast<uint64_t>(offset) > found->second ||
        static_cast<uint64_t>(length) > found->second - static_cast<uint64_t>(offset)) {
      throw CheckpointError(concat("trainloop: the DCP data file ", untrusted_file_path(directory / relative_path), " has ", found->second,
                                   " bytes, but the item of ", escape_untrusted(fqn), " is at bytes ", offset, "-", offset + length,
                                   "; expected every item inside its file (is the file truncated?)"));
    }
  };
  // Each chunk's item holds at least its box's bytes (and parse_metadata checked that the boxes
  // cover the tensor): so nothing is allocated for a tensor whose data the files do not have (sizes
  // of 2^40 elements were allocated before any data was read, the allocator's error naming no file).
  for (const auto& [fqn, entry] : metadata.tensors) {
    const auto element = static_cast<int64_t>(c10::elementSize(entry.dtype));
    for (const auto& chunk : entry.chunks) {
      check(fqn, chunk.relative_path, chunk.offset, chunk.length);
      const int64_t count = checked_numel(chunk.sizes);
      if (count < 0 || count > chunk.length / element) {
        throw CheckpointError(concat("trainloop: the item of ", escape_untrusted(fqn), " in ", untrusted_file_path(directory / chunk.relative_path),
                                     " has ", chunk.length, " bytes, but its box of size ", c10::IntArrayRef(chunk.sizes), " of ",
                                     entry.dtype, " needs ", count < 0 ? std::string("more than 2^63") : std::to_string(count * element),
                                     "; expected an item that holds its box"));
      }
    }
  }
  for (const auto& [fqn, entry] : metadata.bytes) check(fqn, entry.relative_path, entry.offset, entry.length);
}

/// @brief Reads directory/".metadata" (parse_metadata), then check_items_in_files.
/// @throws trainloop::CheckpointError naming the file: missing, larger than a pickle may be, not
///         DCP's metadata (see parse_metadata), naming a missing file or a range outside one.
inline Metadata read_metadata(const std::filesystem::path& directory) {
  using trainloop::detail::concat;
  const auto path = directory / kMetadataFileName;
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    throw CheckpointError(concat("trainloop: ", path.string(), " does not exist; expected the .metadata of a torch.distributed.checkpoint directory"));
  }
  std::ifstream in(path, std::ios::binary);
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(in.tellg());
  const size_t limit = PickleLimits{}.max_pickle_bytes;
  if (!in || size > limit) {
    throw CheckpointError(concat("trainloop: ", path.string(), " has ", size, " bytes; expected a readable file of at most ", limit));
  }
  std::string bytes(size, '\0');
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(size));
  if (!in) throw CheckpointError(concat("trainloop: cannot read ", path.string(), "; expected a readable file"));
  Metadata metadata = parse_metadata(bytes, path.string());
  check_items_in_files(directory, metadata);
  return metadata;
}

}  // namespace trainloop::serialization::dcp
