// A model's weights as safetensors: one file and Hugging Face's sharded form, loaded back by name;
// then the streaming pieces a sharded model uses: declared tensors written one at a time, and a
// flat element range read from its bytes only.
#include <trainloop/interop.hpp>

#include <filesystem>
#include <iostream>

namespace interop = trainloop::interop;
namespace serialization = trainloop::serialization;

int main() {
  const auto dir = std::filesystem::temp_directory_path() / "trainloop-safetensors-snippet";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  torch::nn::Sequential model(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));

  // One file ("0.weight", "0.bias", "2.weight", "2.bias": Python's state_dict names), and the
  // sharded form: model-0000k-of-0000n.safetensors + model.safetensors.index.json.
  interop::save_safetensors(*model, dir / "model.safetensors");
  interop::save_safetensors(*model, dir / "sharded", {.max_shard_bytes = 256});

  torch::nn::Sequential copy(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 2));
  const auto report = interop::load_safetensors(*copy, dir / "sharded");  // strict: all or nothing
  std::cout << std::boolalpha << report.loaded.size() << " tensors loaded; equal: " << torch::equal(copy[0]->as<torch::nn::Linear>()->weight,
                                                                               model[0]->as<torch::nn::Linear>()->weight)
            << '\n';

  // Streaming: names, dtypes and shapes first (the header), then each tensor when it is written.
  std::vector<serialization::SafetensorsSpec> specs = {{"embedding", torch::kBFloat16, {1000, 64}},
                                                       {"step", torch::kInt64, {}}};
  serialization::write_safetensors(dir / "stream.safetensors", specs, [](size_t i) {
    return i == 0 ? torch::ones({1000, 64}, torch::kBFloat16) : torch::tensor(int64_t{42});
  });
  const serialization::SafetensorsFile file(dir / "stream.safetensors");
  for (const auto& entry : file.entries()) std::cout << entry.name << ' ' << entry.dtype << ' ' << entry.numel() << '\n';
  const torch::Tensor rows = file.read_flat("embedding", 64 * 10, 64 * 12);  // rows 10 and 11, flattened
  std::cout << "read " << rows.numel() << " elements of embedding; step = " << file.read("step").item<int64_t>() << '\n';
  std::filesystem::remove_all(dir);
  return 0;
}
