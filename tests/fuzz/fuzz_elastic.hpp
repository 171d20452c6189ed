#pragma once
// Elastic training's reader of a neighbour's copy of sharded state for
// tests/fuzz/fuzz_weight_files.cpp (include/trainloop/distributed/elastic/):
//   fuzz_shared_copy: the input is a copy's file as a rank leaves it in /dev/shm
//     (shared_copy_file.hpp: block, descriptor, trailer), read as a keeper reads it after a loss:
//     read_shared_copy for the step its trailer names (so mutations get past the step check) and
//     for step 7 (the seeds'), decode_boxes, every box's bytes touched, and the boxes written as
//     the lost rank's `.distcp` file, as write_captured_rank_file does in the hand-off.
// The file is written by a rank of the job, not a stranger; but it lies in /dev/shm beside other
// programs' files and outlives its writer, so it is read as a stranger's: clear errors, never a crash.

#include "fuzz_dcp.hpp"

#include <trainloop/distributed/elastic/box_descriptor.hpp>
#include <trainloop/distributed/elastic/shared_copy_file.hpp>
#include <trainloop/serialization/dcp/distcp_writer.hpp>
#include <trainloop/serialization/dcp/metadata_pickle.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string_view>

namespace fuzz_elastic {

namespace elastic = trainloop::distributed::elastic;

inline void read_copy_of_step(const std::filesystem::path& file, int64_t step) {
  try {
    const auto [descriptor, block] = elastic::read_shared_copy(file, step);
    const auto boxes = elastic::detail::decode_boxes(descriptor, block);
    for (const auto& box : boxes) fuzz_dcp::touch_bytes(box.buffer);
    // What the keeper does next: the boxes become the lost rank's file of the hand-off.
    try {
      trainloop::serialization::dcp::DistcpWriter writer(file.parent_path(), 1);
      for (const auto& box : boxes) writer.add_tensor_chunk(box.key, box.buffer, box.offsets, box.size);
      (void)trainloop::serialization::dcp::metadata_pickle(writer.finish());
    } catch (const trainloop::CheckpointError&) {
    }
  } catch (const trainloop::CommunicationError&) {
  }
}

inline void fuzz_shared_copy(std::string_view bytes) {
  const std::filesystem::path file = fuzz_dcp::item_file().parent_path() / "copy";
  std::ofstream(file, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (bytes.size() >= static_cast<size_t>(elastic::detail::kSharedCopyTrailerBytes)) {
    int64_t named = 0;
    std::memcpy(&named, bytes.data() + bytes.size() - elastic::detail::kSharedCopyTrailerBytes + 16, 8);
    read_copy_of_step(file, named);
  }
  read_copy_of_step(file, 7);
}

}  // namespace fuzz_elastic
