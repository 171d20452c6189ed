#pragma once
/// @file
/// @brief Writing a .safetensors file as a stream: the tensors' names, dtypes and shapes are
/// declared first, so the header (and every offset) is written before any data; then each tensor
/// is asked of a callback, in order, written, and dropped. A sharded model gathers one tensor at a
/// time and never holds more than one. The file is written atomically (detail/atomic_file.hpp).

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/safetensors/safetensors_header.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

namespace trainloop::serialization {

/// @brief What a tensor of a safetensors file will be, declared before its data is written.
struct SafetensorsSpec {
  std::string name;              ///< its name in the file (unique, not "__metadata__")
  torch::ScalarType dtype{};     ///< its dtype (one safetensors_dtype_name() knows)
  std::vector<int64_t> shape;    ///< its shape (empty: a scalar)
};

/// @brief Supplies tensor `index` of the specs (any device, any layout; it must have the spec's
/// dtype and shape). Called once per tensor, in order; what it returns is dropped once written.
using SafetensorsProducer = std::function<torch::Tensor(size_t index)>;

/// @brief `__metadata__` as transformers' `save_pretrained` passes it to `safetensors.torch.save_file`:
/// {"format": "pt"} (save_file itself writes none unless given one).
inline std::map<std::string, std::string> safetensors_pt_metadata() { return {{"format", "pt"}}; }

/// @brief The bytes one spec's tensor takes in a file.
/// @throws trainloop::ConfigurationError for a negative size or a byte count over int64.
inline uint64_t safetensors_spec_bytes(const SafetensorsSpec& spec) {
  uint64_t bytes = c10::elementSize(spec.dtype);
  for (const auto size : spec.shape) {
    TRAINLOOP_CHECK(size >= 0, "safetensors tensor ", escape_untrusted(spec.name), " has shape ", c10::IntArrayRef(spec.shape),
                    "; expected non-negative sizes");
    TRAINLOOP_CHECK(size == 0 || bytes <= uint64_t(std::numeric_limits<int64_t>::max()) / uint64_t(size),
                    "safetensors tensor ", escape_untrusted(spec.name), " of shape ", c10::IntArrayRef(spec.shape),
                    " takes more than 2^63 bytes; expected less");
    bytes *= uint64_t(size);
  }
  return bytes;
}

namespace detail {

/// The header entries of `specs`, laid out back to back; checks names and dtypes first.
inline std::vector<SafetensorsEntry> plan_safetensors(const std::vector<SafetensorsSpec>& specs, const std::string& file) {
  std::vector<SafetensorsEntry> entries;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& spec : specs) {
    TRAINLOOP_CHECK(spec.name != "__metadata__", "safetensors file ", file,
                    ": a tensor is named __metadata__; expected another name (the key is the metadata's)");
    TRAINLOOP_CHECK(names.insert(spec.name).second, "safetensors file ", file, ": tensor ", escape_untrusted(spec.name),
                    " is declared twice; expected unique names");
    safetensors_dtype_name(spec.dtype);  // throws for a dtype safetensors cannot hold
    const uint64_t bytes = safetensors_spec_bytes(spec);
    entries.push_back({spec.name, spec.dtype, spec.shape, offset, offset + bytes});
    offset += bytes;
  }
  return entries;
}

/// The produced tensor `index`, checked against its spec, on the CPU in row-major order.
inline torch::Tensor produced_tensor(const SafetensorsProducer& produce, const SafetensorsSpec& spec, size_t index,
                                     const std::string& file) {
  torch::Tensor tensor = produce(index);
  TRAINLOOP_CHECK(tensor.defined(), "safetensors file ", file, ": the producer gave no tensor for ",
                  escape_untrusted(spec.name), " (index ", index, "); expected a ", spec.dtype, " tensor of shape ",
                  c10::IntArrayRef(spec.shape));
  TRAINLOOP_CHECK(tensor.scalar_type() == spec.dtype && tensor.sizes() == c10::IntArrayRef(spec.shape),
                  "safetensors file ", file, ": tensor ", escape_untrusted(spec.name), " (index ", index, ") is ",
                  tensor.scalar_type(), " of shape ", tensor.sizes(), "; expected ", spec.dtype, " of shape ",
                  c10::IntArrayRef(spec.shape), " as declared");
  // contiguous(): a transposed or channels-last tensor is written in row-major order.
  return tensor.detach().to(torch::kCPU).contiguous();
}

}  // namespace detail

/// @brief Writes a .safetensors file: the header of `specs` first, then each tensor that
/// `produce(i)` returns, in the order of `specs`, one at a time. The file appears complete or not
/// at all (written to a temporary file, renamed over `path`).
/// @param path the file to write
/// @param specs every tensor's name, dtype and shape, in file order
/// @param produce returns tensor i (it must match specs[i]); its result is released once written
/// @param metadata `__metadata__` (omitted when empty); by default {"format": "pt"}, as transformers writes
/// @throws trainloop::ConfigurationError for a bad spec, or a produced tensor of another dtype or
///         shape; trainloop::CheckpointError naming the file when it cannot be written. The
///         previous file at `path`, if any, is untouched then.
inline void write_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsSpec>& specs,
                              const SafetensorsProducer& produce,
                              const std::map<std::string, std::string>& metadata = safetensors_pt_metadata()) {
  const auto entries = detail::plan_safetensors(specs, path.string());
  trainloop::detail::BasicAtomicFile<CheckpointError> file(path, "the safetensors file");
  file.write(safetensors_header_bytes(entries, metadata));
  for (size_t i = 0; i < specs.size(); ++i) {
    const torch::Tensor tensor = detail::produced_tensor(produce, specs[i], i, path.string());
    const auto bytes = entries[i].end - entries[i].begin;
    if (bytes > 0) file.write(std::string_view(static_cast<const char*>(tensor.data_ptr()), bytes));
  }
  file.commit();
}

}  // namespace trainloop::serialization
