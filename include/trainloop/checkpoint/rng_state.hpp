#pragma once
/// @file
/// @brief The state of this process's random number generators (CPU, and every CUDA device) as
/// one byte tensor, so a checkpoint can restore the exact random stream (dropout masks,
/// augmentation) of every rank.
///
/// Layout of the byte tensor: int64 count n, then n int64 lengths, then the n generator states
/// (CPU first, then cuda:0 .. cuda:n-2), all as raw bytes.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/error.hpp>

#include <ATen/Context.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <vector>

namespace trainloop::detail {

/// The generators of this process: CPU, then every visible CUDA device.
inline std::vector<at::Generator> rng_generators() {
  std::vector<at::Generator> generators{at::globalContext().defaultGenerator(torch::Device(torch::kCPU))};
  if (torch::cuda::is_available()) {
    for (size_t i = 0; i < trainloop::detail::cuda_device_count(); ++i) {
      generators.push_back(
          at::globalContext().defaultGenerator(torch::Device(torch::kCUDA, static_cast<c10::DeviceIndex>(i))));
    }
  }
  return generators;
}

/// Every generator's state, packed into one uint8 CPU tensor (see the file comment).
inline torch::Tensor capture_rng_state() {
  std::vector<torch::Tensor> states;
  for (auto& generator : rng_generators()) {
    std::lock_guard<std::mutex> lock(generator.mutex());
    states.push_back(generator.get_state().to(torch::kCPU).contiguous());
  }
  std::vector<int64_t> header{static_cast<int64_t>(states.size())};
  for (const auto& state : states) header.push_back(state.numel());
  std::vector<torch::Tensor> parts{torch::from_blob(header.data(), {static_cast<int64_t>(header.size() * sizeof(int64_t))},
                                                    torch::kUInt8)
                                       .clone()};
  for (const auto& state : states) parts.push_back(state.view(torch::kUInt8).reshape({-1}));
  return torch::cat(parts);
}

/// The generator states inside what capture_rng_state() packed, checked and unpacked, in
/// rng_generators() order; nothing is restored.
/// @throws trainloop::ConfigurationError when `packed` is not such a tensor.
inline std::vector<torch::Tensor> unpack_rng_state(const torch::Tensor& packed) {
  const torch::Tensor bytes = packed.to(torch::kCPU).contiguous();
  TRAINLOOP_CHECK(bytes.scalar_type() == torch::kUInt8, "the random number generator state has dtype ",
                  bytes.scalar_type(), "; expected Byte, as written by trainloop");
  const auto* data = bytes.data_ptr<uint8_t>();
  const int64_t size = bytes.numel();
  auto read_int = [&](int64_t offset) {
    TRAINLOOP_CHECK(offset + static_cast<int64_t>(sizeof(int64_t)) <= size, "the random number generator state is ",
                    size, " bytes, too short; expected one written by trainloop");
    int64_t value = 0;
    std::memcpy(&value, data + offset, sizeof value);
    return value;
  };
  const int64_t count = read_int(0);
  TRAINLOOP_CHECK(count >= 1 && count <= 1024, "the random number generator state lists ", count,
                  " generators; expected 1 (CPU) or more");
  int64_t offset = static_cast<int64_t>((1 + count) * sizeof(int64_t));
  std::vector<torch::Tensor> states;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t length = read_int(static_cast<int64_t>((1 + i) * sizeof(int64_t)));
    TRAINLOOP_CHECK(length >= 0 && offset + length <= size, "the random number generator state is truncated; "
                    "expected ", offset + length, " bytes, got ", size);
    states.push_back(bytes.narrow(0, offset, length).clone());
    offset += length;
  }
  return states;
}

/// Restores what capture_rng_state() packed, after checking all of it; generators the packed
/// state has no entry for (fewer CUDA devices when it was written) keep theirs.
/// @throws trainloop::ConfigurationError when `packed` is not such a tensor (nothing restored).
inline void restore_rng_state(const torch::Tensor& packed) {
  const std::vector<torch::Tensor> states = unpack_rng_state(packed);
  auto generators = rng_generators();
  for (size_t i = 0; i < states.size() && i < generators.size(); ++i) {
    std::lock_guard<std::mutex> lock(generators[i].mutex());
    generators[i].set_state(states[i]);
  }
}

}  // namespace trainloop::detail
