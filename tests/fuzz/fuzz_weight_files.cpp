// libFuzzer target over the safe unpickler and the tensor rebuild (include/trainloop/serialization/):
// each input is a pickle, read as torch.save's data.pkl (first byte even) or as a TorchScript
// archive's (odd), with storages of up to 2^16 elements made in memory for any key it names.
// Then what a reader does with the result is done too: the state_dict's (name, tensor) pairs,
// or the module tree's tensors, and every tensor's bytes are read (so a view outside its storage
// is an ASan report, not a silent read).
//
// Built and run by the ctest test `fuzz_weight_files` (tests/fuzz/run_fuzz.cmake) with clang's
// -fsanitize=fuzzer,address; seeds: tests/fuzz/corpus (scripts/make-fuzz-corpus.py).
#include <trainloop/serialization/pickle_reader.hpp>
#include <trainloop/serialization/torch_archive.hpp>

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace {

void touch(const torch::Tensor& tensor) {
  if (tensor.numel() == 0 || tensor.device().type() != torch::kCPU) return;
  // Reads every element the view reaches, through libtorch's own strided loop.
  volatile double sum = tensor.to(torch::kDouble).sum().item<double>();
  (void)sum;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace trainloop::serialization;
  if (size < 1) return 0;
  const auto flavor = (data[0] & 1) ? PickleFlavor::TorchScript : PickleFlavor::StateDict;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  auto load_storage = [](const std::string&, torch::ScalarType dtype, int64_t numel) {
    if (numel > (int64_t{1} << 16)) throw PickleError("storage too large for the fuzzer");
    return torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
  };
  PickleLimits limits;
  limits.max_value_bytes = size_t{64} << 20;  // the fuzzer's RSS limit is 2 GiB
  try {
    const PickleDocument document = Unpickler(bytes, flavor, load_storage, limits).run();
    if (document.root.kind == PickleValue::Kind::Dict) {
      const auto& items = document.items(document.root);
      for (size_t i = 0; i + 1 < items.size(); i += 2) {
        if (items[i + 1].kind == PickleValue::Kind::Tensor) touch(document.tensor(items[i + 1]));
      }
    } else if (document.root.kind == PickleValue::Kind::Object) {
      for (const auto& [name, tensor] : module_tensors(document)) touch(tensor);
    }
  } catch (const PickleError&) {
  }
  return 0;
}
