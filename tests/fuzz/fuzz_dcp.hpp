#pragma once
// The DCP readers of include/trainloop/serialization/dcp/ for tests/fuzz/fuzz_weight_files.cpp:
//   fuzz_dcp_metadata: the input is a `.metadata` pickle: parse_metadata, every entry touched,
//     and what parsed must write (metadata_pickle) and parse again to the same metadata;
//   fuzz_dcp_item: the input is a `.distcp` tensor item (a torch.save blob) in a file: read as
//     DistcpReader::read_chunk reads it for a fixed entry (float32 [2, 3], one chunk), and as
//     DistcpItem reads any tensor (whole, and a flat run of a row-major one).

#include <trainloop/serialization/dcp/distcp_reader.hpp>
#include <trainloop/serialization/dcp/metadata_parse.hpp>
#include <trainloop/serialization/dcp/metadata_pickle.hpp>

#include <torch/torch.h>

#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <string_view>

namespace fuzz_dcp {

namespace dcp = trainloop::serialization::dcp;

/// Reads every byte of a contiguous CPU tensor (an ASan report if any is outside its memory).
inline void touch_bytes(const torch::Tensor& tensor) {
  const auto* bytes = static_cast<const volatile unsigned char*>(tensor.data_ptr());
  unsigned sum = 0;
  for (size_t at = 0; at < tensor.nbytes(); ++at) sum += bytes[at];
  static volatile unsigned sink = 0;
  sink = sink + sum;
}

inline bool same(const dcp::Metadata& a, const dcp::Metadata& b) {
  if (a.tensors.size() != b.tensors.size() || a.bytes.size() != b.bytes.size()) return false;
  for (const auto& [fqn, entry] : a.tensors) {
    const auto found = b.tensors.find(fqn);
    if (found == b.tensors.end() || found->second.dtype != entry.dtype || found->second.size != entry.size ||
        found->second.requires_grad != entry.requires_grad || found->second.chunks.size() != entry.chunks.size()) {
      return false;
    }
    for (size_t i = 0; i < entry.chunks.size(); ++i) {
      const auto &x = entry.chunks[i], &y = found->second.chunks[i];
      if (x.offsets != y.offsets || x.sizes != y.sizes || x.relative_path != y.relative_path || x.offset != y.offset || x.length != y.length) {
        return false;
      }
    }
  }
  for (const auto& [fqn, entry] : a.bytes) {
    const auto found = b.bytes.find(fqn);
    if (found == b.bytes.end() || found->second.relative_path != entry.relative_path || found->second.offset != entry.offset ||
        found->second.length != entry.length) {
      return false;
    }
  }
  return true;
}

inline void fuzz_dcp_metadata(std::string_view bytes) {
  dcp::Metadata metadata;
  try {
    metadata = dcp::parse_metadata(bytes, "fuzzed .metadata");
  } catch (const trainloop::CheckpointError&) {
    return;  // refused with the error a user sees
  }
  size_t sum = 0;
  for (const auto& [fqn, entry] : metadata.tensors) {
    sum += fqn.size() + entry.size.size();
    for (const auto& chunk : entry.chunks) sum += chunk.relative_path.size() + chunk.offsets.size() + chunk.sizes.size();
  }
  for (const auto& [fqn, entry] : metadata.bytes) sum += fqn.size() + entry.relative_path.size();
  for (const auto& [fqn, path] : metadata.planner_data) sum += path.size();
  static volatile size_t sink = 0;
  sink = sink + sum;
  // What parsed is a checkpoint's metadata: written again, it must read back the same.
  const auto again = dcp::parse_metadata(dcp::metadata_pickle(metadata), "rewritten .metadata");
  if (!same(metadata, again)) std::abort();
}

/// The directory an item is written to (as its file `__0_0.distcp`): one per fuzzing process,
/// removed when it exits.
inline const std::filesystem::path& item_file() {
  struct Scratch {
    std::filesystem::path directory;
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove_all(directory, ignored);
    }
  };
  static const Scratch scratch{[] {
    const std::filesystem::path shm = "/dev/shm";
    const auto base = std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path();
    auto directory = base / ("trainloop-fuzz-dcp-" + std::to_string(::getpid()));
    std::filesystem::create_directories(directory);
    return directory;
  }()};
  static const std::filesystem::path file = scratch.directory / "__0_0.distcp";
  return file;
}

inline void fuzz_dcp_item(std::string_view bytes) {
  const auto& file = item_file();
  std::ofstream(file, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  const uint64_t size = bytes.size();
  const auto directory = file.parent_path();
  dcp::Metadata metadata;
  auto& entry = metadata.tensors["t"];
  entry.fqn = "t";
  entry.dtype = torch::kFloat;
  entry.size = {2, 3};
  entry.chunks.push_back({{0, 0}, {2, 3}, file.filename().string(), 0, static_cast<int64_t>(size)});
  try {
    dcp::DistcpReader reader(directory, metadata);
    touch_bytes(reader.read_chunk(entry.chunks[0]));
    touch_bytes(reader.read_flat_range(entry, 1, 5));
  } catch (const trainloop::CheckpointError&) {
  }
  try {
    const dcp::ReadOnlyFile opened(file);
    const dcp::DistcpItem item(opened, 0, static_cast<int64_t>(size));
    const auto whole = item.read();
    touch_bytes(whole);
    if (item.row_major() && whole.numel() > 1) {
      auto part = torch::empty({whole.numel() - 1}, whole.options());
      item.read_flat(1, whole.numel() - 1, part.data_ptr());
      touch_bytes(part);
    }
  } catch (const trainloop::CheckpointError&) {
  }
}

}  // namespace fuzz_dcp
