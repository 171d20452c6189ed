#define BOOST_TEST_MODULE test_safetensors
#include "unit_test.hpp"

// Safetensors (serialization/safetensors/, interop/safetensors_weights.hpp): every dtype
// written and read back bit for bit, flat ranges, the streaming writer, Hugging Face's sharded
// form, a model's weights by name, every defect of a stranger's file as an error naming the file
// and the problem, and both directions against Python's `safetensors` package (PyPI; cases
// Skipped per case where the reference python lacks it).

#include "python_reference.hpp"
#include "test_support.hpp"

#include <trainloop/interop.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/json_dom_cost.hpp>
#include <trainloop/serialization/nesting_depth.hpp>
#include <trainloop/serialization/safetensors/safetensors_index.hpp>

#include <malloc.h>
#include <sys/stat.h>

#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace interop = trainloop::interop;
namespace serialization = trainloop::serialization;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

/// A tensor's row-major bytes.
std::string bytes_of(const torch::Tensor& tensor) {
  const auto dense = tensor.contiguous();
  return std::string(static_cast<const char*>(dense.data_ptr()), dense.numel() * dense.element_size());
}

/// Same dtype, shape and bytes (NaN payloads included).
bool identical(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && bytes_of(a) == bytes_of(b);
}

/// Random bits of `dtype` (every float bit pattern, NaNs included; bools 0 or 1).
torch::Tensor random_bits(torch::ScalarType dtype, std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (const auto size : shape) numel *= size;
  if (dtype == torch::kBool) return torch::randint(0, 2, shape, torch::kUInt8).to(torch::kBool);
  const int64_t item = static_cast<int64_t>(c10::elementSize(dtype));
  return torch::randint(0, 256, {numel * item}, torch::kUInt8).view(dtype).view(shape);
}

/// One tensor of every dtype this libtorch has, of assorted shapes (a scalar, empty, 4-D).
std::vector<std::pair<std::string, torch::Tensor>> every_dtype() {
  torch::manual_seed(7);
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const std::vector<std::vector<int64_t>> shapes = {{3, 5}, {7}, {}, {2, 3, 4, 5}, {0, 3}, {4, 1, 6}};
  size_t k = 0;
  for (const auto& [name, dtype] : serialization::detail::safetensors_dtypes()) {
    const auto shape = shapes[k++ % shapes.size()];
    tensors.emplace_back("t." + std::string(name), random_bits(dtype, shape));
  }
  // A transposed and a channels-last tensor: written row-major.
  tensors.emplace_back("transposed", torch::arange(12, torch::kFloat32).view({3, 4}).t());
  tensors.emplace_back("channels_last", torch::randn({2, 3, 4, 5}).contiguous(torch::MemoryFormat::ChannelsLast));
  return tensors;
}

std::vector<serialization::SafetensorsSpec> specs_of(const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  std::vector<serialization::SafetensorsSpec> specs;
  for (const auto& [name, tensor] : tensors) specs.push_back({name, tensor.scalar_type(), tensor.sizes().vec()});
  return specs;
}

void write_all(const fs::path& path, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  serialization::write_safetensors(path, specs_of(tensors), [&](size_t i) { return tensors[i].second; });
}

/// A file of `json` as its header (its length in front) and `data` after it.
std::string crafted(const std::string& json, const std::string& data = "") {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((uint64_t(json.size()) >> (8 * i)) & 0xff);
  return bytes + json + data;
}

/// The error opening and reading every tensor of `bytes` as a .safetensors file gives.
std::string error_of_file(const TempDir& dir, const std::string& bytes) {
  const auto path = dir.path / "bad.safetensors";
  write_bytes(path, bytes);
  return error_of([&] {
    serialization::SafetensorsFile file(path);
    for (const auto& entry : file.entries()) file.read(entry.name);
  });
}

struct Net : torch::nn::Module {
  torch::nn::Conv2d conv{torch::nn::Conv2dOptions(3, 4, 3)};
  torch::nn::BatchNorm2d bn{4};
  torch::nn::Linear fc{4, 2};
  Net() {
    register_module("conv", conv);
    register_module("bn", bn);
    register_module("fc", fc);
  }
};

// ---- Python's safetensors ------------------------------------------------------------------------

constexpr const char* kScript = R"PY(
import json, os, sys
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

command, work = sys.argv[1], sys.argv[2]

def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

def every_dtype():
    g = torch.Generator().manual_seed(3)
    dtypes = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
              torch.int8, torch.uint8, torch.bool]
    dtypes += [d for d in (getattr(torch, 'float8_e4m3fn', None), getattr(torch, 'float8_e5m2', None)) if d]
    shapes = [(3, 5), (7,), (), (2, 3, 4, 5), (0, 3), (4, 1, 6)]
    out = {}
    for k, dtype in enumerate(dtypes):
        shape = shapes[k % len(shapes)]
        n = 1
        for s in shape:
            n *= s
        if dtype == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            item = torch.empty((), dtype=dtype).element_size()
            t = torch.randint(0, 256, (n * item,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
        out['py.' + str(dtype).replace('torch.', '')] = t
    return out

def load_any(path):
    if path.endswith('.json'):
        index = json.load(open(path))
        tensors = {}
        for shard in sorted(set(index['weight_map'].values())):
            tensors.update(load_file(os.path.join(os.path.dirname(path), shard)))
        assert sorted(tensors) == sorted(index['weight_map']), 'index and shards disagree'
        return tensors, None
    with safe_open(path, 'pt') as f:
        metadata = f.metadata()
    return load_file(path), metadata

if command == 'write':
    # Every dtype by save_file, one file and Hugging Face's sharded form written by hand, and the
    # raw bytes of each tensor for C++ to compare with.
    tensors = every_dtype()
    save_file(tensors, os.path.join(work, 'py.safetensors'))
    os.makedirs(os.path.join(work, 'py_raw'), exist_ok=True)
    for name, t in tensors.items():
        open(os.path.join(work, 'py_raw', name), 'wb').write(raw(t))
    sharded = os.path.join(work, 'py_sharded')
    os.makedirs(sharded, exist_ok=True)
    names = list(tensors)
    groups = [names[0:4], names[4:8], names[8:]]
    weight_map = {}
    for k, group in enumerate(groups):
        shard = 'model-%05d-of-%05d.safetensors' % (k + 1, len(groups))
        save_file({n: tensors[n] for n in group}, os.path.join(sharded, shard), metadata={'format': 'pt'})
        weight_map.update({n: shard for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map},
              open(os.path.join(sharded, 'model.safetensors.index.json'), 'w'), indent=2)
    print('WROTE', len(tensors))
elif command == 'check':
    # Reads C++'s file (or index) with safetensors and compares every tensor's dtype, shape and
    # bytes with what C++ wrote beside it (cpp_raw/<name>, cpp_raw/<name>.meta).
    tensors, metadata = load_any(sys.argv[3])
    print('METADATA', json.dumps(metadata, sort_keys=True))
    for name, t in sorted(tensors.items()):
        meta = open(os.path.join(work, 'cpp_raw', name + '.meta')).read().split()
        expected = open(os.path.join(work, 'cpp_raw', name), 'rb').read()
        same = raw(t) == expected and str(t.dtype) == meta[0] and list(t.shape) == [int(s) for s in meta[1:]]
        print('TENSOR', name, str(t.dtype), list(t.shape), 'EQUAL' if same else 'DIFFERENT')
    print('COUNT', len(tensors))
)PY";

/// Whether the reference python imports safetensors (the PyPI package).
bool python_has_safetensors() {
  static const bool found = !reference_python().empty() &&
                            std::system(("'" + reference_python() + "' -c 'import safetensors' >/dev/null 2>&1").c_str()) == 0;
  return found;
}

/// Precondition of the cases against Python's safetensors.
boost::test_tools::assertion_result safetensors_present(boost::unit_test::test_unit_id) {
  if (python_has_safetensors()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: no python3 imports torch and safetensors (scripts/install-deps.sh; TRAINLOOP_PYTHON)"
            << std::endl;
  boost::test_tools::assertion_result result(false);
  result.message() << "no python3 with safetensors";
  return result;
}

/// Python dtype names are lower case ("torch.float32"); c10's are "Float".
std::string python_dtype(torch::ScalarType dtype) {
  static const std::map<torch::ScalarType, std::string> names = {
      {torch::kFloat64, "float64"}, {torch::kFloat32, "float32"}, {torch::kFloat16, "float16"}, {torch::kBFloat16, "bfloat16"},
      {torch::kInt64, "int64"},     {torch::kInt32, "int32"},     {torch::kInt16, "int16"},     {torch::kInt8, "int8"},
      {torch::kUInt8, "uint8"},     {torch::kBool, "bool"},
      {torch::kFloat8_e4m3fn, "float8_e4m3fn"}, {torch::kFloat8_e5m2, "float8_e5m2"},
  };
  return names.at(dtype);
}

/// C++'s raw bytes and "dtype sizes..." of each tensor, for the Python side to compare with.
void write_cpp_raw(const fs::path& work, const std::vector<std::pair<std::string, torch::Tensor>>& tensors) {
  fs::create_directories(work / "cpp_raw");
  for (const auto& [name, tensor] : tensors) {
    write_bytes(work / "cpp_raw" / name, bytes_of(tensor));
    // A stream: "literal" + std::string draws a false -Wstringop-overflow from GCC 12 here.
    std::ostringstream meta;
    meta << "torch." << python_dtype(tensor.scalar_type());
    for (const auto size : tensor.sizes()) meta << ' ' << size;
    write_bytes(work / "cpp_raw" / (name + ".meta"), meta.str());
  }
}

}  // namespace

// ---- C++ round trips ------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(every_dtype_round_trips_bit_for_bit) {
  TempDir dir;
  const auto tensors = every_dtype();
  const auto path = dir.path / "every.safetensors";
  write_all(path, tensors);
  const serialization::SafetensorsFile file(path);
  BOOST_TEST(file.entries().size() == tensors.size());
  BOOST_TEST((file.metadata() == std::map<std::string, std::string>{{"format", "pt"}}));
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    BOOST_TEST_CONTEXT(name) {
      BOOST_TEST(file.entries()[i].name == name);  // written in declared order
      BOOST_TEST((file.entry(name).dtype == tensor.scalar_type()));
      const auto back = file.read(name);
      BOOST_TEST(identical(back, tensor));
      BOOST_TEST(back.is_contiguous());
    }
  }
  // Row-major whatever the layout: the transposed tensor's values in its logical order.
  BOOST_TEST(torch::equal(file.read("transposed"), torch::arange(12, torch::kFloat32).view({3, 4}).t().contiguous()));
  // The header is padded to 8 bytes, as safetensors pads it.
  const std::string bytes = read_bytes(path);
  uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | static_cast<unsigned char>(bytes[i]);
  BOOST_TEST(header % 8 == 0u);
}

BOOST_AUTO_TEST_CASE(flat_range_reads_equal_the_slice) {
  TempDir dir;
  const auto tensors = every_dtype();
  const auto path = dir.path / "every.safetensors";
  write_all(path, tensors);
  const serialization::SafetensorsFile file(path);
  for (const auto& [name, tensor] : tensors) {
    const int64_t n = tensor.numel();
    for (const auto& [begin, end] : std::vector<std::pair<int64_t, int64_t>>{{0, n}, {0, n / 2}, {n / 3, n}, {n / 2, n / 2}}) {
      BOOST_TEST_CONTEXT(name << " [" << begin << ", " << end << ")") {
        BOOST_TEST(identical(file.read_flat(name, begin, end), tensor.contiguous().view(-1).slice(0, begin, end)));
      }
    }
  }
  const auto message = error_of([&] { file.read_flat("t.F32", 5, 8); });
  BOOST_TEST(contains(message, path.string()));
  BOOST_TEST(contains(message, "\"t.F32\" of 7 elements; the range [5, 8) asked of it is outside"));
  BOOST_TEST(contains(error_of([&] { file.read_flat("t.F32", -1, 2); }), "the range [-1, 2)"));
  BOOST_TEST(contains(error_of([&] { file.read("nope"); }), "has no tensor \"nope\""));
}

BOOST_AUTO_TEST_CASE(streaming_writer_asks_for_one_tensor_at_a_time_in_order) {
  TempDir dir;
  const auto tensors = every_dtype();
  const auto path = dir.path / "stream.safetensors";
  std::vector<size_t> asked;
  serialization::write_safetensors(path, specs_of(tensors), [&](size_t i) {
    asked.push_back(i);
    BOOST_TEST(!fs::exists(path));  // atomic: nothing at the path before the end
    return tensors[i].second;
  });
  std::vector<size_t> in_order(tensors.size());
  for (size_t i = 0; i < in_order.size(); ++i) in_order[i] = i;
  BOOST_TEST(asked == in_order, boost::test_tools::per_element());
  // A produced tensor unlike its spec is an error and the previous file stays.
  const std::string before = read_bytes(path);
  auto specs = specs_of(tensors);
  specs[1].shape = {8};
  const auto message = error_of([&] {
    serialization::write_safetensors(path, specs, [&](size_t i) { return tensors[i].second; });
  });
  BOOST_TEST(contains(message, "tensor t.F32 (index 1) is Float of shape [7]; expected Float of shape [8] as declared"));
  BOOST_TEST(contains(message, path.string()));
  BOOST_TEST(read_bytes(path) == before);
  for (const auto& entry : fs::directory_iterator(dir.path)) BOOST_TEST(entry.path() == path);  // no temporary left
  specs = specs_of(tensors);
  specs.push_back(specs[0]);
  BOOST_TEST(contains(error_of([&] { serialization::write_safetensors(path, specs, [&](size_t i) { return tensors[i].second; }); }),
                      "tensor t.F64 is declared twice; expected unique names"));
  BOOST_TEST(contains(error_of([&] { serialization::write_safetensors(path, {{"c", torch::kComplexFloat, {2}}}, nullptr); }),
                      "has no safetensors name"));
  // Empty metadata: no __metadata__ key.
  serialization::write_safetensors(path, {{"x", torch::kFloat32, {2}}}, [](size_t) { return torch::ones({2}); }, {});
  BOOST_TEST(serialization::SafetensorsFile(path).metadata().empty());
  BOOST_TEST(!contains(read_bytes(path), "__metadata__"));
}

BOOST_AUTO_TEST_CASE(sharded_form_round_trips_and_never_splits_a_tensor) {
  TempDir dir;
  const auto tensors = every_dtype();
  const auto specs = specs_of(tensors);
  const uint64_t max_shard = 400;
  const auto index = serialization::write_safetensors_sharded(dir.path / "sharded", specs, [&](size_t i) { return tensors[i].second; },
                                                              max_shard);
  BOOST_TEST(index == dir.path / "sharded" / "model.safetensors.index.json");
  // Expected shards: greedy in order, a new one when the next tensor would pass max_shard.
  std::vector<std::vector<std::string>> expected;
  uint64_t in_shard = 0, total = 0;
  for (const auto& spec : specs) {
    const auto bytes = serialization::safetensors_spec_bytes(spec);
    if (expected.empty() || (in_shard > 0 && in_shard + bytes > max_shard)) expected.emplace_back(), in_shard = 0;
    expected.back().push_back(spec.name);
    in_shard += bytes;
    total += bytes;
  }
  BOOST_TEST_REQUIRE(expected.size() > 2u);
  const auto document = nlohmann::json::parse(read_bytes(index));
  BOOST_TEST(document["metadata"]["total_size"].get<uint64_t>() == total);
  for (size_t k = 0; k < expected.size(); ++k) {
    const auto shard = serialization::safetensors_shard_name(k + 1, expected.size());
    const serialization::SafetensorsFile file(dir.path / "sharded" / shard);
    BOOST_TEST(file.entries().size() == expected[k].size());
    for (const auto& name : expected[k]) BOOST_TEST(document["weight_map"][name].get<std::string>() == shard);
  }
  BOOST_TEST(serialization::safetensors_shard_name(1, 3) == "model-00001-of-00003.safetensors");
  for (const auto& opened : {dir.path / "sharded", index}) {
    const serialization::SafetensorsSource source(opened);
    BOOST_TEST(source.entries().size() == tensors.size());
    for (const auto& [name, tensor] : tensors) {
      BOOST_TEST(identical(source.read(name), tensor));
      BOOST_TEST(identical(source.read_flat(name, 0, tensor.numel() / 2), tensor.contiguous().view(-1).slice(0, 0, tensor.numel() / 2)));
    }
  }
  // Saved again with one shard: the old shards go, the index names the one.
  serialization::write_safetensors_sharded(dir.path / "sharded", specs, [&](size_t i) { return tensors[i].second; }, 1u << 30);
  size_t files = 0;
  for (const auto& entry : fs::directory_iterator(dir.path / "sharded")) ++files, (void)entry;
  BOOST_TEST(files == 2u);
  BOOST_TEST(serialization::SafetensorsSource(dir.path / "sharded").entries().size() == tensors.size());
}

BOOST_AUTO_TEST_CASE(model_weights_round_trip_by_state_dict_name) {
  TempDir dir;
  torch::manual_seed(1);
  Net saved;
  saved.conv->weight.set_data(saved.conv->weight.detach().contiguous(torch::MemoryFormat::ChannelsLast));
  saved.bn->running_mean.uniform_();
  saved.bn->num_batches_tracked.fill_(5);
  for (const auto& path : {dir.path / "net.safetensors", dir.path / "net_dir/", dir.path / "hf" / "model.safetensors.index.json"}) {
    BOOST_TEST_CONTEXT(path) {
      fs::create_directories(dir.path / "hf");
      interop::save_safetensors(saved, path);
      torch::manual_seed(2);
      Net loaded;
      const auto report = interop::load_safetensors(loaded, path);
      BOOST_TEST(report.complete());
      BOOST_TEST(report.loaded.size() == 9u);  // conv 2, bn 2 + 3 buffers, fc 2
      const auto a = interop::module_state_dict(saved), b = interop::module_state_dict(loaded);
      for (size_t i = 0; i < a.size(); ++i) BOOST_TEST(identical(a[i].second, b[i].second), a[i].first);
    }
  }
  BOOST_TEST(fs::exists(dir.path / "net_dir" / "model-00001-of-00001.safetensors"));
  // Several shards through the options.
  interop::save_safetensors(saved, dir.path / "small_shards", {.max_shard_bytes = 64});
  BOOST_TEST(fs::exists(dir.path / "small_shards" / "model-00003-of-00003.safetensors"));
  Net loaded;
  interop::load_safetensors(loaded, dir.path / "small_shards");
  BOOST_TEST(torch::equal(loaded.fc->weight, saved.fc->weight));
}

BOOST_AUTO_TEST_CASE(model_that_does_not_fit_is_a_clear_error_and_stays_unchanged) {
  TempDir dir;
  Net net;
  const auto path = dir.path / "net.safetensors";
  const auto before = interop::module_state_dict(net)[0].second.clone();
  auto write = [&](std::vector<std::pair<std::string, torch::Tensor>> tensors) { write_all(path, tensors); };
  auto state = interop::module_state_dict(net);
  // Missing and unexpected names.
  auto renamed = state;
  renamed[0].first = "conv.kernel";
  write(renamed);
  auto message = error_of([&] { interop::load_safetensors(net, path); });
  BOOST_TEST(contains(message, "safetensors weights " + path.string() + " does not fit the model"));
  BOOST_TEST(contains(message, "1 missing (conv.weight)"));
  BOOST_TEST(contains(message, "1 unexpected (conv.kernel)"));
  // Another shape.
  auto reshaped = state;
  reshaped[2].second = torch::zeros({5});
  write(reshaped);
  message = error_of([&] { interop::load_safetensors(net, path); });
  BOOST_TEST(contains(message, "1 wrong shape (bn.weight is [5] in the file; expected [4]"));
  // Another dtype: an error even when not strict.
  auto retyped = state;
  retyped[4].second = retyped[4].second.to(torch::kFloat64);
  write(retyped);
  for (const bool strict : {true, false}) {
    message = error_of([&] { interop::load_safetensors(net, path, {.strict = strict}); });
    BOOST_TEST(contains(message, path.string()));
    BOOST_TEST(contains(message, "tensor \"bn.running_mean\" is Double in the file; expected Float"));
  }
  BOOST_TEST(identical(interop::module_state_dict(net)[0].second, before));
  // Not strict: what fits is copied, the rest reported.
  auto partial = state;
  partial.erase(partial.begin());
  for (auto& [name, tensor] : partial) tensor = tensor.detach().clone().fill_(1);
  write(partial);
  const auto report = interop::load_safetensors(net, path, {.strict = false});
  BOOST_TEST(report.missing == std::vector<std::string>{"conv.weight"}, boost::test_tools::per_element());
  BOOST_TEST(report.loaded.size() == state.size() - 1);
  BOOST_TEST(torch::all(net.fc->bias == 1).item<bool>());
  BOOST_TEST(identical(net.conv->weight, before));
  // Not safetensors weights at all.
  message = error_of([&] { interop::load_safetensors(net, dir.path / "absent.safetensors"); });
  BOOST_TEST(contains(message, "absent.safetensors cannot be opened"));
  message = error_of([&] { interop::load_safetensors(net, dir.path); });
  BOOST_TEST(contains(message, "holds neither model.safetensors.index.json nor model.safetensors"));
}

// ---- Files from strangers -------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(bad_files_are_errors_naming_the_file_and_the_problem) {
  TempDir dir;
  const std::string path = (dir.path / "bad.safetensors").string();
  const std::string f32x2 = R"("dtype": "F32", "shape": [2])";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"short", "is 5 bytes long; expected at least 8 (the header's length)"},
      {"longer", "has a header length (its first 8 bytes) beyond the 12 bytes after it; expected a .safetensors file"},
      {"huge", "has a header length (its first 8 bytes) over the limit of 100000000 bytes (100 MB); expected a .safetensors file"},
      {"not json", "has a header that is not JSON ("},
      {"array", "has a header that is JSON array; expected a JSON object of tensors"},
      {"dtype", "has tensor \"w\" of dtype \"F7\"; expected one of F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL"},
      {"negative", "has tensor \"w\" of shape [2,-1]; expected non-negative integer sizes"},
      {"overflow", "has tensor \"w\" of shape [4611686018427387904,4], whose byte count overflows int64"},
      {"u64 dim", "has tensor \"w\" of shape [18446744073709551615], whose byte count overflows int64"},
      {"outside", "has tensor \"w\"'s data_offsets = [0, 16] outside the data; expected end <= 8 (the bytes after the header)"},
      {"reversed", "has tensor \"w\"'s data_offsets = [8, 0], which end before they begin; expected end >= begin"},
      {"size", "has tensor \"w\"'s data_offsets = [0, 4], 4 bytes; expected 8 (2 elements of 4 bytes)"},
      {"overlap", "has tensor \"b\" at data_offsets [4, 12], overlapping \"a\" (up to 8); expected tensors that do not overlap"},
      {"hole", "has a hole: data bytes [8, 12) belong to no tensor; expected the data fully indexed"},
      {"hole at end", "has a hole: data bytes [8, 16) belong to no tensor; expected the data fully indexed"},
      {"offsets", "has tensor \"w\"'s data_offsets = [0]; expected [begin, end]"},
      {"negative offset", "has tensor \"w\"'s data_offsets[0] = -8; expected a non-negative integer"},
      {"no shape", "has tensor \"w\" without 'shape'; expected one"},
      {"not entry", "has tensor \"w\" as JSON number; expected an object with dtype, shape and data_offsets"},
      {"metadata", "has __metadata__ \"format\" = 1; expected a string"},
      {"deep", "has a header nesting JSON 4 levels deep; expected at most 3"},
      {"bool", "has BOOL tensor \"w\" holding byte 7 at element 1; expected 0 or 1"},
  };
  const std::string data8(8, '\0');
  auto file_of = [&](const std::string& name) -> std::string {
    if (name == "short") return std::string(5, '\0');
    if (name == "longer") return std::string("\xe8\x03\0\0\0\0\0\0", 8) + std::string(12, ' ');
    if (name == "huge") return std::string("\0\xc2\xeb\x0b\0\0\0\0", 8) + "{}";
    if (name == "not json") return crafted("{\"w\": ", data8);
    if (name == "array") return crafted("[1, 2]");
    if (name == "dtype") return crafted(R"({"w": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}})", data8);
    if (name == "negative") return crafted(R"({"w": {"dtype": "F32", "shape": [2,-1], "data_offsets": [0, 8]}})", data8);
    if (name == "overflow") return crafted(R"({"w": {"dtype": "F32", "shape": [4611686018427387904,4], "data_offsets": [0, 8]}})", data8);
    if (name == "u64 dim") return crafted(R"({"w": {"dtype": "I8", "shape": [18446744073709551615], "data_offsets": [0, 8]}})", data8);
    if (name == "outside") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [0, 16]}})", data8);
    if (name == "reversed") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [8, 0]}})", data8);
    if (name == "size") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [0, 4]}})", data8);
    if (name == "overlap") {
      return crafted("{\"a\": {" + f32x2 + R"(, "data_offsets": [0, 8]}, "b": {)" + f32x2 + R"(, "data_offsets": [4, 12]}})",
                     std::string(12, '\0'));
    }
    if (name == "hole") {
      return crafted("{\"a\": {" + f32x2 + R"(, "data_offsets": [0, 8]}, "b": {)" + f32x2 + R"(, "data_offsets": [12, 20]}})",
                     std::string(20, '\0'));
    }
    if (name == "hole at end") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [0, 8]}})", std::string(16, '\0'));
    if (name == "offsets") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [0]}})", data8);
    if (name == "negative offset") return crafted("{\"w\": {" + f32x2 + R"(, "data_offsets": [-8, 0]}})", data8);
    if (name == "no shape") return crafted(R"({"w": {"dtype": "F32", "data_offsets": [0, 8]}})", data8);
    if (name == "not entry") return crafted(R"({"w": 3})", data8);
    if (name == "metadata") return crafted(R"({"__metadata__": {"format": 1}})");
    if (name == "deep") return crafted(R"({"w": {"dtype": "F32", "shape": [[2]], "data_offsets": [0, 8]}})", data8);
    if (name == "bool") return crafted(R"({"w": {"dtype": "BOOL", "shape": [3], "data_offsets": [0, 3]}})", std::string("\1\7\0", 3));
    return "";
  };
  for (const auto& [name, expected] : cases) {
    BOOST_TEST_CONTEXT(name) {
      const auto message = error_of_file(dir, file_of(name));
      BOOST_TEST(contains(message, "trainloop: safetensors file " + path + " "), message);
      BOOST_TEST(contains(message, expected), message);
    }
  }
  // Header padded with spaces, empty tensors at one offset, a file of no tensors: all valid.
  write_bytes(path, crafted(R"({"e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]}, "w": {)" + f32x2 +
                                R"(, "data_offsets": [0, 8]}, "z": {"dtype": "I8", "shape": [0], "data_offsets": [8, 8]}}      )",
                            std::string("\0\0\x80\x3f\0\0\0\x40", 8)));
  const serialization::SafetensorsFile padded(path);
  BOOST_TEST(padded.entries().size() == 3u);
  BOOST_TEST(torch::equal(padded.read("w"), torch::tensor({1.0f, 2.0f})));
  BOOST_TEST(padded.read("e").sizes() == torch::IntArrayRef({0, 3}));
  write_bytes(path, crafted("{}"));
  BOOST_TEST(serialization::SafetensorsFile(path).entries().empty());
}

BOOST_AUTO_TEST_CASE(bad_indexes_are_errors_naming_the_index) {
  TempDir dir;
  write_all(dir.path / "model-00001-of-00001.safetensors", {{"a", torch::ones({2})}, {"b", torch::zeros({3})}});
  const auto index = dir.path / "model.safetensors.index.json";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{", "is not JSON ("},
      {R"({"metadata": {}})", "has no weight_map object"},
      {R"({"weight_map": {"a": "../model-00001-of-00001.safetensors"}})",
       "maps tensor \"a\" to \"../model-00001-of-00001.safetensors\"; expected a file name in the index's directory"},
      {R"({"weight_map": {"a": 3}})", "maps tensor \"a\" to 3; expected a file name"},
      {R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "c": "model-00001-of-00001.safetensors"}})",
       "maps tensor \"c\" to \"model-00001-of-00001.safetensors\", which has no such tensor"},
      {R"({"weight_map": {"a": "model-00001-of-00001.safetensors"}})",
       "does not map tensor \"b\" to \"model-00001-of-00001.safetensors\", which holds it"},
      {R"({"weight_map": {"a": "model-00002-of-00002.safetensors"}})", "model-00002-of-00002.safetensors cannot be opened"},
  };
  for (const auto& [json, expected] : cases) {
    BOOST_TEST_CONTEXT(json) {
      write_bytes(index, json);
      const auto message = error_of([&] { serialization::SafetensorsSource source(dir.path); });
      BOOST_TEST((contains(message, index.string()) || contains(message, dir.path.string())), message);
      BOOST_TEST(contains(message, expected), message);
    }
  }
}

BOOST_AUTO_TEST_CASE(strangers_names_in_messages_are_escaped_and_cut) {
  // A name from a file reaches a message quoted, at most 200 bytes of it, its control bytes
  // escaped (issue 50): a 100,000-byte name holding a terminal escape sequence neither grows the
  // message nor acts on the terminal that prints it.
  TempDir dir;
  const std::string name = "\\u001b[31m" + std::string(100000, 'n');  // JSON's escape of ESC
  const std::string data8(8, '\0');
  const std::vector<std::pair<std::string, std::string>> files = {
      {"tensor name", crafted("{\"" + name + R"(": {"dtype": "F7", "shape": [2], "data_offsets": [0, 8]}})", data8)},
      {"dtype", crafted(R"({"w": {"dtype": ")" + name + R"(", "shape": [2], "data_offsets": [0, 8]}})", data8)},
      {"metadata key", crafted(R"({"__metadata__": {")" + name + R"(": 1}})")},
  };
  auto check = [](const std::string& message) {
    BOOST_TEST(message.size() < 1000u, message.size() << " bytes: " << message.substr(0, 300));
    BOOST_TEST(message.find('\x1b') == std::string::npos);
    BOOST_TEST(contains(message, "\\x1b[31mnnn"), message.substr(0, 300));
    BOOST_TEST(contains(message, " bytes in all)"), message.substr(0, 300));
  };
  for (const auto& [what, bytes] : files) {
    BOOST_TEST_CONTEXT(what) { check(error_of_file(dir, bytes)); }
  }
  // An index's shard file name, and its tensor name.
  write_all(dir.path / "model-00001-of-00001.safetensors", {{"a", torch::ones({2})}});
  const auto index = dir.path / "model.safetensors.index.json";
  const std::vector<std::string> indexes = {R"({"weight_map": {"a": ")" + name + R"("}})",
                                            R"({"weight_map": {")" + name + R"(": "model-00001-of-00001.safetensors"}})"};
  for (const auto& json : indexes) {
    write_bytes(index, json);
    check(error_of([&] { serialization::SafetensorsSource source(dir.path); }));
  }
}

BOOST_AUTO_TEST_CASE(special_files_are_refused_without_blocking_or_reading_them) {
  // A FIFO as the file, the index or a shard used to block open() forever; an index linked to
  // /dev/zero was read until memory ran out (issue 50). Each must be an error at once.
  TempDir dir;
  const auto fifo = dir.path / "pipe.safetensors";
  BOOST_REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto message = error_of([&] { serialization::SafetensorsFile file(fifo); });
  BOOST_TEST(contains(message, fifo.string() + " is a FIFO, not a regular file; expected a .safetensors file"), message);

  const auto sharded = dir.path / "sharded";
  fs::create_directories(sharded);
  write_all(sharded / "model-00001-of-00001.safetensors", {{"a", torch::ones({2})}});
  BOOST_REQUIRE(::mkfifo((sharded / "model.safetensors.index.json").c_str(), 0600) == 0);
  message = error_of([&] { serialization::SafetensorsSource source(sharded); });
  BOOST_TEST(contains(message, "model.safetensors.index.json is a FIFO, not a regular file; expected an index file"), message);

  fs::remove(sharded / "model.safetensors.index.json");
  fs::create_symlink("/dev/zero", sharded / "model.safetensors.index.json");
  message = error_of([&] { serialization::SafetensorsSource source(sharded); });
  BOOST_TEST(contains(message, "is a character device, not a regular file; expected an index file"), message);

  fs::remove(sharded / "model.safetensors.index.json");
  write_bytes(sharded / "model.safetensors.index.json", R"({"weight_map": {"a": "model-00001-of-00001.safetensors", "b": "shard-pipe"}})");
  BOOST_REQUIRE(::mkfifo((sharded / "shard-pipe").c_str(), 0600) == 0);
  message = error_of([&] { serialization::SafetensorsSource source(sharded); });
  BOOST_TEST(contains(message, "shard-pipe is a FIFO, not a regular file"), message);

  // A shard that links to some other file: refused without showing that file's first bytes.
  fs::remove(sharded / "shard-pipe");
  write_bytes(dir.path / "secret.txt", "password=hunter2 and more text after it");
  fs::create_symlink(dir.path / "secret.txt", sharded / "shard-pipe");
  message = error_of([&] { serialization::SafetensorsSource source(sharded); });
  BOOST_TEST(contains(message, "has a header length (its first 8 bytes) over the limit"), message);
  const uint64_t first8 = 0x3d64726f77737361ull;  // "password" as a little-endian length
  BOOST_TEST(!contains(message, std::to_string(first8)), message);
  BOOST_TEST(!contains(message, "password"), message);

  // A link to a regular safetensors file (Hugging Face's cache: snapshots/ -> blobs/) is followed.
  fs::remove(sharded / "shard-pipe");
  write_all(dir.path / "blob", {{"b", torch::zeros({3})}});
  fs::create_symlink(dir.path / "blob", sharded / "shard-pipe");
  serialization::SafetensorsSource linked(sharded);
  BOOST_TEST(linked.entries().size() == 2u);
}

BOOST_AUTO_TEST_CASE(json_nesting_is_counted_outside_strings) {
  using serialization::json_depth_beyond;
  BOOST_TEST(json_depth_beyond(R"({"a": [1, {"b": []}]})", 4) == 0);
  BOOST_TEST(json_depth_beyond(R"({"a": [1, {"b": []}]})", 2) == 3);
  BOOST_TEST(json_depth_beyond(R"({"[[[[": "{{{{", "\"[[[": 1})", 1) == 0);  // brackets in strings, an escaped quote
  BOOST_TEST(json_depth_beyond(R"(["\\", [[1]]])", 2) == 3);                // an escaped backslash ends no string
  BOOST_TEST(json_depth_beyond(std::string(100000, '[') + std::string(100000, ']'), 64) == 65);
  BOOST_TEST(json_depth_beyond("]]]]{}", 1) == 0);  // malformed: left for the parser to refuse
}

BOOST_AUTO_TEST_CASE(json_memory_is_charged_before_parsing_and_bounds_what_parsing_takes) {
  using serialization::json_dom_bytes;
  // The charges (json_dom_cost.hpp): root 16, object 64, member 96, string 48, array 32, element 32,
  // a key or string beyond 15 bytes its length + 9 rounded up to 16; nothing inside strings counts
  // as structure.
  BOOST_TEST(json_dom_bytes("0") == 16u);
  BOOST_TEST(json_dom_bytes("[]") == 16u + 32u);
  BOOST_TEST(json_dom_bytes("{}") == 16u + 64u);
  BOOST_TEST(json_dom_bytes("[0, -1.5e3, true]") == 16u + 32u + 3u * 32u);
  BOOST_TEST(json_dom_bytes(R"({"a": "", "b": [null]})") == 16u + 64u + 2u * 96u + 48u + 32u + 32u);
  BOOST_TEST(json_dom_bytes(R"(["a\"b,{[", ""])") == 16u + 32u + 2u * 32u + 2u * 48u);
  BOOST_TEST(json_dom_bytes("{\"" + std::string(20, 'k') + "\": 1}") == 16u + 64u + 96u + 32u);

  // The charges bound what nlohmann::json takes (glibc's heap in use, before and after), for the
  // documents that cost the most per byte of each kind of value.
  const auto repeated = [](const std::string& item, size_t count) {
    std::string text = "[";
    for (size_t i = 0; i < count; ++i) text += (i ? "," : "") + item;
    return text + "]";
  };
  std::string members = "{";
  for (int i = 0; i < 50000; ++i) members += (i ? ",\"" : "\"") + std::to_string(i) + "\":0";
  members += "}";
  for (const std::string& text : {repeated("{}", 100000), repeated("0", 100000), repeated("\"\"", 100000),
                                  repeated("[]", 100000), repeated("\"" + std::string(40, 's') + "\"", 20000), members}) {
    BOOST_TEST_CONTEXT(text.substr(0, 12) << "... (" << text.size() << " bytes)") {
      const size_t before = mallinfo2().uordblks;
      const auto document = nlohmann::json::parse(text);  // what parse_untrusted_json builds, unrefused
      const size_t after = mallinfo2().uordblks;
      BOOST_TEST(document.size() > 0u);
      BOOST_TEST(after - before <= json_dom_bytes(text));
    }
  }

  // Past kJsonMemoryPerByte (16) bytes per byte + 1 MiB: refused before anything is built, naming
  // the cost and the bound. A list of empty objects is charged 32 per byte; a list of zeros 16.
  const std::string objects = repeated("{}", 1 << 20);
  const std::string message = error_of([&] { serialization::parse_untrusted_json(objects, "models/model.json", 64); });
  BOOST_TEST(contains(message, "models/model.json is JSON of " + std::to_string(objects.size()) + " bytes whose document would take " +
                                   std::to_string(json_dom_bytes(objects)) + " bytes of memory; expected at most " +
                                   std::to_string(16 * objects.size() + (1 << 20))),
             message);
  BOOST_TEST(serialization::parse_untrusted_json(repeated("0", 1 << 20), "zeros", 64).size() == size_t(1) << 20);
}

// ---- Against Python's safetensors -----------------------------------------------------------------

BOOST_AUTO_TEST_CASE(python_reads_ours_bit_for_bit, *boost::unit_test::precondition(safetensors_present)) {
  TempDir dir;
  const auto tensors = every_dtype();
  write_all(dir.path / "cpp.safetensors", tensors);
  write_cpp_raw(dir.path, tensors);
  serialization::write_safetensors_sharded(dir.path / "cpp_sharded", specs_of(tensors), [&](size_t i) { return tensors[i].second; },
                                           300);
  for (const auto& file : {dir.path / "cpp.safetensors", dir.path / "cpp_sharded" / "model.safetensors.index.json"}) {
    BOOST_TEST_CONTEXT(file) {
      const auto run = run_python_script(dir.path, "safetensors_check.py", kScript, "check", {file.string()});
      BOOST_TEST_REQUIRE(run.exit_code == 0, run.output);
      BOOST_TEST(contains(run.output, "COUNT " + std::to_string(tensors.size())), run.output);
      BOOST_TEST(!contains(run.output, "DIFFERENT"), run.output);
      if (file.extension() == ".safetensors") BOOST_TEST(contains(run.output, "METADATA {\"format\": \"pt\"}"), run.output);
      for (const auto& [name, tensor] : tensors) {
        BOOST_TEST(contains(run.output, "TENSOR " + name + " torch." + python_dtype(tensor.scalar_type())), name);
      }
    }
  }
}

BOOST_AUTO_TEST_CASE(ours_reads_pythons_bit_for_bit, *boost::unit_test::precondition(safetensors_present)) {
  TempDir dir;
  const auto run = run_python_script(dir.path, "safetensors_write.py", kScript, "write");
  BOOST_TEST_REQUIRE(run.exit_code == 0, run.output);
  size_t expected = 0;
  for (const auto& entry : fs::directory_iterator(dir.path / "py_raw")) ++expected, (void)entry;
  BOOST_TEST(expected == serialization::detail::safetensors_dtypes().size());
  for (const auto& opened : {dir.path / "py.safetensors", dir.path / "py_sharded", dir.path / "py_sharded" / "model.safetensors.index.json"}) {
    BOOST_TEST_CONTEXT(opened) {
      const serialization::SafetensorsSource source(opened);
      BOOST_TEST(source.entries().size() == expected);
      for (const auto* entry : source.entries()) {
        const auto tensor = source.read(entry->name);
        BOOST_TEST(bytes_of(tensor) == read_bytes(dir.path / "py_raw" / entry->name), entry->name);
        BOOST_TEST(entry->name == "py." + python_dtype(entry->dtype));
      }
    }
  }
  // save_file writes no __metadata__ unless given one; the shards were given {"format": "pt"}.
  BOOST_TEST(serialization::SafetensorsFile(dir.path / "py.safetensors").metadata().empty());
  BOOST_TEST((serialization::SafetensorsFile(dir.path / "py_sharded" / "model-00001-of-00003.safetensors").metadata() ==
              std::map<std::string, std::string>{{"format", "pt"}}));
  // And a model's weights from Python's file, by name (dtypes as the file has them).
  const serialization::SafetensorsFile file(dir.path / "py.safetensors");
  struct Holder : torch::nn::Module {};
  Holder holder;
  for (const auto& entry : file.entries()) {
    holder.register_buffer(entry.name.substr(3), torch::empty(entry.shape, torch::TensorOptions().dtype(entry.dtype)));
  }
  // Buffer names have no dots here; the file's have the "py." prefix: not strict, all unexpected.
  const auto report = interop::load_safetensors(holder, dir.path / "py.safetensors", {.strict = false});
  BOOST_TEST(report.unexpected.size() == expected);
  BOOST_TEST(report.missing.size() == expected);
}
