#define BOOST_TEST_MODULE test_dcp_format
#include "unit_test.hpp"

// torch.distributed.checkpoint's on-disk format (include/trainloop/serialization/dcp/): boxes of
// flat ranges, a 2-"rank" checkpoint written here and loaded by Python's DCP (the torch of the same release) into
// zero tensors, any flat range read back here, Python's own checkpoints read here bit for bit,
// every defect a clear CheckpointError naming the file, and the metadata pickle's round trip.
// Python cases need the Python torch of this build's release (its DCP is the reference) and are
// Skipped per case otherwise.

#include "python_reference.hpp"
#include "small_tmpfs.hpp"
#include "test_support.hpp"

#include <trainloop/serialization/dcp/distcp_reader.hpp>
#include <trainloop/serialization/dcp/distcp_writer.hpp>
#include <trainloop/serialization/dcp/flat_range_boxes.hpp>
#include <trainloop/serialization/dcp/metadata_file.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <string>
#include <vector>

namespace fs = std::filesystem;
namespace dcp = trainloop::serialization::dcp;

namespace {

bool contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return true;
  std::cout << "expected \"" << part << "\" in: " << text << "\n";
  return false;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

/// The reference Python (this build's torch release) when its DCP imports, whose DCP is the
/// reference; "" otherwise.
const std::string& dcp_python() {
  static const std::string found = [] {
    if (reference_python().empty()) return std::string();
    const std::string probe = "'" + reference_python() +
                              "' -c 'import sys, torch, torch.distributed.checkpoint; sys.exit(0)' "
                              ">/dev/null 2>&1";
    return std::system(probe.c_str()) == 0 ? reference_python() : std::string();
  }();
  return found;
}

boost::test_tools::assertion_result python_dcp_present(boost::unit_test::test_unit_id) {
  if (!dcp_python().empty()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: no python3 with torch " TORCH_VERSION " and its DCP (the reference; set TRAINLOOP_PYTHON)" << std::endl;
  boost::test_tools::assertion_result result(false);
  result.message() << "no python3 with torch " << TORCH_VERSION << " and its DCP";
  return result;
}

// ---- What Python does ----------------------------------------------------------------------------
const char* kScript = R"PY(
import os, pickle, sys
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata, BytesStorageMetadata

command, work = sys.argv[1], sys.argv[2]

if command == "load_cpp":
    # The C++ checkpoint in work/ck; the expected tensors in work/expected/<fqn> (torch.save).
    ck = os.path.join(work, "ck")
    expected = {name: torch.load(os.path.join(work, "expected", name), weights_only=True)
                for name in sorted(os.listdir(os.path.join(work, "expected")))}
    # The reader's way: FileSystemReader.read_metadata is a pickle.load of .metadata.
    with open(os.path.join(ck, ".metadata"), "rb") as f:
        md = pickle.load(f)
    assert isinstance(md, Metadata), type(md)
    # torch.load(weights_only=True) cannot read any .metadata (a bare pickle, no magic number;
    # Python's own protocol-4 one not even with its classes allowed: FRAME); ours is protocol 2
    # and reads under torch's weights_only unpickler once DCP's classes are allowed.
    import torch.distributed.checkpoint.metadata as m, torch.distributed.checkpoint.filesystem as fsm
    from torch._weights_only_unpickler import load as weights_only_load
    allowed = [m.Metadata, m.TensorStorageMetadata, m.BytesStorageMetadata, m.ChunkStorageMetadata, m.TensorProperties,
               m.MetadataIndex, m.StorageMeta, m._MEM_FORMAT_ENCODING, fsm._StorageInfo, torch.Size, torch.serialization._get_layout]
    with torch.serialization.safe_globals(allowed), open(os.path.join(ck, ".metadata"), "rb") as f:
        assert weights_only_load(f).state_dict_metadata == md.state_dict_metadata
    print("weights_only unpickler reads it")
    md2 = FileSystemReader(ck).read_metadata()
    assert md2.state_dict_metadata == md.state_dict_metadata
    for name, t in expected.items():
        m = md.state_dict_metadata["model." + name]
        assert isinstance(m, TensorStorageMetadata), (name, m)
        assert m.properties.dtype == t.dtype and m.size == t.size(), (name, m)
        assert m.properties.memory_format == torch.contiguous_format
        assert m.properties.layout == torch.strided
    assert isinstance(md.state_dict_metadata["extra.count"], BytesStorageMetadata)
    print("chunks", sum(len(m.chunks) for m in md.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)))
    sd = {name: torch.zeros_like(t) for name, t in expected.items()}
    state = {"model": sd, "extra": {"count": 0}}
    dcp.load(state, checkpoint_id=ck)
    for name, t in expected.items():
        assert sd[name].dtype == t.dtype, name
        assert torch.equal(sd[name], t), (name, (sd[name].double() - t.double()).abs().max())
        print("equal", name, tuple(t.shape), t.dtype)
    assert state["extra"]["count"] == 7, state["extra"]
    # An empty state dict: DCP rebuilds the nesting from planner_data.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    whole = _load_state_dict_from_keys(checkpoint_id=ck)
    assert torch.equal(whole["model"]["w2"], expected["w2"]) and whole["extra"]["count"] == 7, whole.keys()
    print("OK")
elif command == "save":
    # A model's state_dict and an optimizer-like nested dict, with views and several dtypes;
    # every tensor's contiguous bytes in work/raw/<fqn>.
    torch.manual_seed(0)
    ck = os.path.join(work, "py")
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4))
    base = torch.randn(6, 5)
    state = {
        "model": model.state_dict(),
        "optim": {"state": {"fc.weight": {"exp_avg": base.t(), "exp_avg_sq": base[1:4, 2:], "step": torch.tensor(3.)}},
                  "param_groups": [{"lr": 0.1, "params": ["fc.weight"]}]},
        "extra": {"half": torch.randn(3, 2).half(), "bf16": torch.randn(7).bfloat16(), "ints": torch.arange(-5, 5),
                  "flags": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3)},
    }
    dcp.save(state, checkpoint_id=ck)
    os.makedirs(os.path.join(work, "raw"), exist_ok=True)
    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            with open(os.path.join(work, "raw", prefix), "wb") as f:
                f.write(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
        elif isinstance(value, dict):
            for k, v in value.items(): walk(prefix + "." + k if prefix else k, v)
        elif isinstance(value, list):
            for i, v in enumerate(value): walk(prefix + "." + str(i), v)
    walk("", state)
    print("OK")
)PY";

PythonRun python(const fs::path& work, const std::string& command) {
  const auto script = work / "dcp_reference.py";
  std::ofstream(script) << kScript;
  const std::string line = "'" + dcp_python() + "' '" + script.string() + "' " + command + " '" + work.string() + "' 2>&1";
  PythonRun run;
  FILE* pipe = ::popen(line.c_str(), "r");
  BOOST_REQUIRE(pipe != nullptr);
  char buffer[4096];
  for (size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0;) run.output.append(buffer, n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::cout << run.output;
  return run;
}

// ---- A 2-"rank" checkpoint written here ------------------------------------------------------------

/// The tensors of the checkpoint, by name: several dtypes and shapes.
std::map<std::string, torch::Tensor> model_tensors() {
  torch::manual_seed(1);
  std::map<std::string, torch::Tensor> tensors;
  tensors["w1"] = torch::randn({5, 7});
  tensors["w2"] = torch::randn({4, 3, 2}).to(torch::kBFloat16);
  tensors["w3"] = torch::arange(-10, 23, torch::kLong);
  tensors["w4"] = torch::randn({3, 4, 5, 2}, torch::kDouble);
  tensors["w5"] = torch::randn({6, 2}) > 0;
  tensors["w6"] = torch::randn({2, 3}).to(torch::kHalf).t();  // a view: written contiguous
  tensors["scalar"] = torch::tensor(2.5);
  tensors["empty"] = torch::zeros({0, 3}, torch::kInt);  // an entry with one empty chunk, written by both ranks
  return tensors;
}

/// Rank 0 writes elements [0, k) of every tensor, rank 1 [k, n), k = 2n/5 (inside a row), and a
/// bytes value; the merged metadata goes to `.metadata`.
dcp::Metadata write_two_ranks(const fs::path& directory, const std::map<std::string, torch::Tensor>& tensors) {
  fs::create_directories(directory);
  std::vector<dcp::Metadata> parts;
  for (int rank = 0; rank < 2; ++rank) {
    dcp::DistcpWriter writer(directory, rank);
    for (const auto& [name, tensor] : tensors) {
      const int64_t n = tensor.numel(), k = 2 * n / 5 + (n > 1 ? 1 : 0);
      const int64_t begin = rank == 0 ? 0 : k, end = rank == 0 ? k : n;
      const auto flat = tensor.contiguous().view({-1}).narrow(0, begin, end - begin);
      writer.add_flat_range("model." + name, flat, begin, tensor.sizes().vec());
      writer.set_planner_path("model." + name, {"model", name});
    }
    if (rank == 1) {
      writer.add_bytes("extra.count", [] {
        const auto saved = torch::jit::pickle_save(c10::IValue(int64_t{7}));
        return std::string(saved.data(), saved.size());
      }());
      writer.set_planner_path("extra.count", {"extra", "count"});
    }
    parts.push_back(writer.finish());
  }
  // Each part travels to rank 0 as its pickle (it covers only its rank's elements).
  std::vector<dcp::Metadata> shipped;
  for (const auto& part : parts) shipped.push_back(dcp::parse_metadata(dcp::metadata_pickle(part), "a rank's part", /*complete=*/false));
  auto merged = dcp::merge_metadata(shipped);
  dcp::write_metadata(directory, merged);
  return merged;
}

// ---- Crafted items and pickles ---------------------------------------------------------------------

/// A pickle being written, opcode by opcode (protocol 2, as torch.save writes data.pkl).
struct Pickle {
  std::string bytes = std::string("\x80\x02", 2);
  Pickle& op(char opcode) { return bytes += opcode, *this; }
  Pickle& text(const std::string& value) {  // BINUNICODE
    op('X');
    for (int i = 0; i < 4; ++i) bytes += static_cast<char>((value.size() >> (8 * i)) & 0xff);
    bytes += value;
    return *this;
  }
  Pickle& global(const std::string& module, const std::string& name) { return op('c'), bytes += module + "\n" + name + "\n", *this; }
  Pickle& integer(int64_t value) {  // LONG1 of 8 bytes
    op('\x8a').op('\x08');
    for (int i = 0; i < 8; ++i) bytes += static_cast<char>((static_cast<uint64_t>(value) >> (8 * i)) & 0xff);
    return *this;
  }
  Pickle& ints(const std::vector<int64_t>& values) {
    op('(');
    for (auto value : values) integer(value);
    return op('t');
  }
  /// `_rebuild_tensor_v2(('storage', torch.FloatStorage, '0', location, numel), offset, size, stride, False, OrderedDict())`.
  Pickle& tensor(int64_t numel, int64_t offset, const std::vector<int64_t>& size, const std::vector<int64_t>& stride,
                 const std::string& location = "cpu", const std::string& storage_type = "FloatStorage") {
    global("torch._utils", "_rebuild_tensor_v2").op('(');
    op('(').text("storage").global("torch", storage_type).text("0").text(location).integer(numel).op('t').op('Q');
    integer(offset).ints(size).ints(stride).op('\x89');
    global("collections", "OrderedDict").op(')').op('R');
    return op('t').op('R');
  }
  std::string stop() { return bytes + "."; }
};

/// A torch archive of `pickle` as data.pkl and `storage` as data/0, as libtorch's writer makes it.
std::string archive_of(const std::string& pickle, const std::string& storage) {
  std::string out;
  {
    caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t size) {
      out.append(static_cast<const char*>(data), size);
      return size;
    });
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    writer.writeRecord("data/0", storage.data(), storage.size());
    writer.writeEndOfFile();
  }
  return out;
}

/// A checkpoint of one tensor "t" (float unless `dtype` says) of `size` whose one chunk is the item `item`.
dcp::Metadata one_item_checkpoint(const fs::path& directory, const std::string& item, const std::vector<int64_t>& size,
                                  torch::ScalarType dtype = torch::kFloat) {
  fs::create_directories(directory);
  write_bytes(directory / "__0_0.distcp", "padding" + item);
  dcp::Metadata metadata;
  auto& entry = metadata.tensors["t"];
  entry.fqn = "t";
  entry.dtype = dtype;
  entry.size = size;
  entry.chunks.push_back({std::vector<int64_t>(size.size(), 0), size, "__0_0.distcp", 7, static_cast<int64_t>(item.size())});
  dcp::write_metadata(directory, metadata);
  return metadata;
}

/// The error of reading every chunk of every tensor of the checkpoint in `directory`.
std::string read_error(const fs::path& directory) {
  return error_of([&] {
    const auto metadata = dcp::read_metadata(directory);
    dcp::DistcpReader reader(directory, metadata);
    for (const auto& [fqn, entry] : metadata.tensors) {
      for (const auto& chunk : entry.chunks) reader.read_chunk(chunk);
      reader.read_flat_range(entry, 0, dcp::checked_numel(entry.size));
    }
  });
}

}  // namespace

BOOST_AUTO_TEST_CASE(flat_range_boxes_match_brute_force) {
  const std::vector<std::vector<int64_t>> shapes = {{7}, {1}, {3, 4}, {1, 5}, {4, 1}, {2, 3, 4}, {3, 1, 2}, {2, 3, 2, 3}, {3, 2, 1, 4}};
  int64_t checked = 0, expected = 0;
  for (const auto& shape : shapes) {
    const int64_t n = dcp::checked_numel(shape);
    expected += (n + 1) * (n + 2) / 2;  // every 0 <= begin <= end <= n
    const size_t limit = 2 * (shape.size() - 1) + 1;
    for (int64_t begin = 0; begin <= n; ++begin) {
      for (int64_t end = begin; end <= n; ++end) {
        const auto boxes = dcp::flat_range_boxes(shape, begin, end);
        BOOST_TEST_REQUIRE(boxes.size() <= limit);
        // Every element of every box, in row-major order within the box, boxes in order: [begin, end).
        std::vector<int64_t> elements;
        for (const auto& [offsets, sizes] : boxes) {
          BOOST_TEST_REQUIRE(dcp::box_is_flat_range(shape, sizes));
          const int64_t count = dcp::checked_numel(sizes);
          BOOST_TEST_REQUIRE(count > 0);
          std::vector<int64_t> index(offsets);
          for (int64_t e = 0; e < count; ++e) {
            elements.push_back(dcp::box_flat_begin(shape, index));
            for (size_t d = index.size(); d-- > 0;) {
              if (++index[d] < offsets[d] + sizes[d]) break;
              index[d] = offsets[d];
            }
          }
          BOOST_TEST_REQUIRE(elements[elements.size() - count] == dcp::box_flat_begin(shape, offsets));
        }
        BOOST_TEST_REQUIRE(static_cast<int64_t>(elements.size()) == end - begin);
        for (int64_t i = 0; i < end - begin; ++i) BOOST_TEST_REQUIRE(elements[i] == begin + i);
        ++checked;
      }
    }
  }
  // A 0-dimensional tensor: one element, one box ({}, {}).
  const auto scalar = dcp::flat_range_boxes({}, 0, 1);
  BOOST_TEST(scalar.size() == 1u);
  BOOST_TEST(scalar[0].first.empty());
  BOOST_TEST(dcp::flat_range_boxes({}, 0, 0).empty());
  BOOST_TEST(contains(error_of([] { dcp::flat_range_boxes({3, 4}, 5, 13); }), "not inside a tensor of 12 elements"));
  std::cout << checked << " ranges checked\n";
  BOOST_TEST(checked == expected);
}

BOOST_AUTO_TEST_CASE(cpp_reads_any_flat_range_of_its_checkpoint) {
  TempDir dir;
  const auto tensors = model_tensors();
  const auto written = write_two_ranks(dir.path / "ck", tensors);
  const auto metadata = dcp::read_metadata(dir.path / "ck");
  BOOST_TEST(metadata.tensors.size() == tensors.size());
  BOOST_TEST(metadata.bytes.size() == 1u);
  dcp::DistcpReader reader(dir.path / "ck", metadata);
  for (const auto& [name, tensor] : tensors) {
    const auto& entry = metadata.tensors.at("model." + name);
    BOOST_TEST(entry.dtype == tensor.scalar_type());
    BOOST_TEST(entry.size == tensor.sizes().vec());
    const auto flat = tensor.contiguous().view({-1});
    const int64_t n = flat.numel();
    // Every cut in 3, and the whole.
    for (int64_t a = 0; a <= n; ++a) {
      for (int64_t b = a; b <= n; b += std::max<int64_t>(1, n / 7)) {
        for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, a}, {a, b}, {b, n}}) {
          const auto part = reader.read_flat_range(entry, begin, end);
          BOOST_TEST_REQUIRE(torch::equal(part, flat.narrow(0, begin, end - begin)), name << " [" << begin << ", " << end << ")");
        }
      }
    }
    // Each chunk whole, as the box of the tensor it is.
    for (const auto& chunk : entry.chunks) {
      auto box = tensor;
      for (size_t d = 0; d < chunk.offsets.size(); ++d) box = box.narrow(static_cast<int64_t>(d), chunk.offsets[d], chunk.sizes[d]);
      BOOST_TEST_REQUIRE(torch::equal(reader.read_chunk(chunk), box));
    }
  }
  const std::string bytes = reader.read_bytes(metadata.bytes.at("extra.count"));
  BOOST_TEST(torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end())).toInt() == 7);
}

BOOST_AUTO_TEST_CASE(a_chunk_is_torch_saves_archive_of_its_elements_byte_for_byte) {
  // The writer streams each chunk's archive (libtorch's pickler and zip writer) from the chunk's
  // memory: the bytes must be pickle_save's of a contiguous copy of it, whatever the view.
  TempDir dir;
  const torch::Tensor block = torch::arange(1000, torch::kFloat32);
  const std::vector<std::pair<std::string, torch::Tensor>> chunks{
      {"view", block.narrow(0, 17, 240).view({12, 20})},  // contiguous, inside a larger storage
      {"transposed", block.narrow(0, 300, 60).view({6, 10}).t()},
      {"own", torch::arange(6, torch::kInt64).view({2, 3})},
      {"empty", torch::zeros({0, 4}, torch::kFloat64)},
      {"scalar", torch::full({}, 2.5, torch::kFloat64)}};
  dcp::DistcpWriter writer(dir.path, 0);
  for (const auto& [name, chunk] : chunks) {
    writer.add_tensor_chunk(name, chunk, std::vector<int64_t>(static_cast<size_t>(chunk.dim()), 0), chunk.sizes().vec());
  }
  const dcp::Metadata part = writer.finish();
  std::ifstream in(dir.path / dcp::distcp_file_name(0), std::ios::binary);
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  dcp::DistcpReader reader(dir.path, part);
  for (const auto& [name, chunk] : chunks) {
    BOOST_TEST_CONTEXT(name) {
      const auto& stored = part.tensors.at(name).chunks.at(0);
      const torch::Tensor copy = chunk.contiguous().clone();
      const std::vector<char> expected = torch::jit::pickle_save(copy);
      BOOST_TEST_REQUIRE(stored.offset + stored.length <= static_cast<int64_t>(file.size()));
      BOOST_TEST(file.substr(static_cast<size_t>(stored.offset), static_cast<size_t>(stored.length)) ==
                 std::string(expected.begin(), expected.end()));
      BOOST_TEST(torch::equal(reader.read_chunk(stored), chunk));
    }
  }
}

BOOST_AUTO_TEST_CASE(a_full_disk_is_finishs_error_naming_the_file_and_nothing_is_left,
                     *boost::unit_test::precondition(can_mount_tmpfs)) {
  // Chunks are streamed through a writer that remembers a failed write and skips the rest: the
  // error comes from finish() (the commit), and the temporary file goes with the writer.
  SmallTmpfs disk(1 << 20);  // 1 MiB; the chunk below is 4 MiB
  BOOST_REQUIRE(disk.mounted);
  const torch::Tensor block = torch::arange(1 << 20, torch::kFloat32);
  {
    dcp::DistcpWriter writer(disk.dir.path, 3);
    writer.add_tensor_chunk("small", block.narrow(0, 0, 16), {0}, {16});
    writer.add_tensor_chunk("big", block.narrow(0, 16, (1 << 20) - 16), {16}, {1 << 20});
    const std::string error = error_of([&] { (void)writer.finish(); });
    BOOST_TEST(contains(error, "__3_0.distcp"), error);
    BOOST_TEST(contains(error, "No space left on device"), error);
  }
  BOOST_TEST(fs::is_empty(disk.dir.path));
}

BOOST_AUTO_TEST_CASE(python_loads_the_cpp_checkpoint, *boost::unit_test::precondition(python_dcp_present)) {
  TempDir dir;
  const auto tensors = model_tensors();
  write_two_ranks(dir.path / "ck", tensors);
  fs::create_directories(dir.path / "expected");
  for (const auto& [name, tensor] : tensors) {
    const auto saved = torch::jit::pickle_save(tensor.contiguous());
    write_bytes(dir.path / "expected" / name, std::string(saved.data(), saved.size()));
  }
  const auto run = python(dir.path, "load_cpp");
  BOOST_TEST(run.exit_code == 0);
  BOOST_TEST(contains(run.output, "OK"));
  BOOST_TEST(contains(run.output, "weights_only unpickler reads it"));
  for (const auto& [name, tensor] : tensors) BOOST_TEST(contains(run.output, "equal " + name + " "));
}

BOOST_AUTO_TEST_CASE(cpp_reads_python_checkpoints_bit_for_bit, *boost::unit_test::precondition(python_dcp_present)) {
  TempDir dir;
  const auto run = python(dir.path, "save");
  BOOST_TEST_REQUIRE(run.exit_code == 0);
  const auto metadata = dcp::read_metadata(dir.path / "py");
  dcp::DistcpReader reader(dir.path / "py", metadata);
  size_t compared = 0;
  for (const auto& entry : fs::directory_iterator(dir.path / "raw")) {
    const std::string fqn = entry.path().filename().string();
    const std::string raw = read_file(entry.path());
    BOOST_TEST_REQUIRE(metadata.tensors.count(fqn) == 1u, fqn);
    const auto& tensor = metadata.tensors.at(fqn);
    const auto whole = reader.read_flat_range(tensor, 0, dcp::checked_numel(tensor.size));
    BOOST_TEST_REQUIRE(static_cast<size_t>(whole.nbytes()) == raw.size(), fqn);
    BOOST_TEST(std::memcmp(whole.data_ptr(), raw.data(), raw.size()) == 0, fqn);
    for (const auto& chunk : tensor.chunks) BOOST_TEST(static_cast<size_t>(reader.read_chunk(chunk).nbytes()) == raw.size());
    ++compared;
  }
  BOOST_TEST(compared == 15u);  // 7 of the model (BatchNorm's num_batches_tracked too), 3 of optim, 5 extra
  BOOST_TEST(metadata.tensors.at("model.1.num_batches_tracked").dtype == torch::kLong);
  BOOST_TEST(metadata.tensors.at("extra.bf16").dtype == torch::kBFloat16);
  BOOST_TEST(metadata.bytes.count("optim.param_groups.0.lr") == 1u);
  BOOST_TEST(metadata.bytes.count("optim.param_groups.0.params") == 1u);
  BOOST_TEST((metadata.planner_data.at("optim.param_groups.0.lr") == std::vector<std::string>{"optim", "param_groups", "0", "lr"}));
  BOOST_TEST((metadata.planner_int_elements.at("optim.param_groups.0.lr") == std::vector<size_t>{2}));
  BOOST_TEST((metadata.planner_data.at("optim.state.fc.weight.exp_avg") ==
              std::vector<std::string>{"optim", "state", "fc.weight", "exp_avg"}));
  for (const auto& [fqn, entry] : metadata.bytes) {
    const std::string bytes = reader.read_bytes(entry);
    BOOST_TEST(bytes.substr(0, 2) == "PK", fqn);  // a torch.save archive
  }
}

BOOST_AUTO_TEST_CASE(metadata_pickle_round_trips) {
  dcp::Metadata metadata;
  auto& entry = metadata.tensors["model.w"];
  entry.fqn = "model.w";
  entry.dtype = torch::kBFloat16;
  entry.size = {4, 3};
  entry.requires_grad = true;
  entry.chunks.push_back({{0, 0}, {1, 3}, "__0_0.distcp", 0, 1000});
  entry.chunks.push_back({{1, 0}, {3, 3}, "__1_0.distcp", int64_t{5} << 33, 1001});
  auto& scalar = metadata.tensors["s"];
  scalar.fqn = "s";
  scalar.dtype = torch::kLong;
  scalar.chunks.push_back({{}, {}, "__0_0.distcp", 1000, 7});
  metadata.bytes["optim.param_groups.0.lr"] = {"optim.param_groups.0.lr", "__1_0.distcp", 2001, 12};
  metadata.planner_data["model.w"] = {"model", "w"};
  metadata.planner_data["optim.param_groups.0.lr"] = {"optim", "param_groups", "0", "lr"};
  metadata.planner_int_elements["optim.param_groups.0.lr"] = {2};
  const auto back = dcp::parse_metadata(dcp::metadata_pickle(metadata), "round trip");
  BOOST_TEST(back.tensors.size() == 2u);
  const auto& w = back.tensors.at("model.w");
  BOOST_TEST(w.dtype == torch::kBFloat16);
  BOOST_TEST(w.requires_grad);
  BOOST_TEST((w.size == std::vector<int64_t>{4, 3}));
  BOOST_TEST_REQUIRE(w.chunks.size() == 2u);
  BOOST_TEST((w.chunks[1].offsets == std::vector<int64_t>{1, 0}));
  BOOST_TEST((w.chunks[1].sizes == std::vector<int64_t>{3, 3}));
  BOOST_TEST(w.chunks[1].relative_path == "__1_0.distcp");
  BOOST_TEST(w.chunks[1].offset == int64_t{5} << 33);
  BOOST_TEST(w.chunks[1].length == 1001);
  BOOST_TEST(back.tensors.at("s").size.empty());
  BOOST_TEST(back.tensors.at("s").chunks.at(0).length == 7);
  BOOST_TEST(back.bytes.at("optim.param_groups.0.lr").offset == 2001);
  BOOST_TEST(back.bytes.at("optim.param_groups.0.lr").length == 12);
  BOOST_TEST(back.planner_data.at("model.w") == metadata.planner_data.at("model.w"));
  BOOST_TEST(back.planner_data.at("optim.param_groups.0.lr") == metadata.planner_data.at("optim.param_groups.0.lr"));
  BOOST_TEST(back.planner_data.size() == 3u);
  BOOST_TEST(back.planner_int_elements == metadata.planner_int_elements);
  // The key without a planner path has its own name as its path.
  BOOST_TEST((back.planner_data.at("s") == std::vector<std::string>{"s"}));
}

BOOST_AUTO_TEST_CASE(bad_checkpoints_are_clear_errors_naming_the_file) {
  TempDir dir;
  const auto metadata = write_two_ranks(dir.path / "ck", model_tensors());
  auto copy_of = [&](const std::string& name) {
    fs::copy(dir.path / "ck", dir.path / name, fs::copy_options::recursive);
    return dir.path / name;
  };
  BOOST_TEST(read_error(dir.path / "ck") == "<no trainloop::Error was thrown>");
  // A data file missing; cut short.
  const auto missing = copy_of("missing");
  fs::remove(missing / "__1_0.distcp");
  const auto missing_error = read_error(missing);
  BOOST_TEST(contains(missing_error, (missing / "__1_0.distcp").string()));
  BOOST_TEST(contains(missing_error, "does not exist"));
  const auto cut = copy_of("cut");
  fs::resize_file(cut / "__1_0.distcp", fs::file_size(cut / "__1_0.distcp") - 100);
  BOOST_TEST(contains(read_error(cut), (cut / "__1_0.distcp").string()));
  BOOST_TEST(contains(read_error(cut), "expected every item inside its file (is the file truncated?)"));
  // An item's range outside its file.
  auto moved = metadata;
  moved.tensors.at("model.w1").chunks.at(0).offset = int64_t{1} << 40;
  const auto outside = copy_of("outside");
  dcp::write_metadata(outside, moved);
  BOOST_TEST(contains(read_error(outside), (outside / "__0_0.distcp").string() + " has "));
  BOOST_TEST(contains(read_error(outside), "the item of model.w1 is at bytes 1099511627776-"));
  // A tensor and its chunk grown to 2^40 elements: refused before anything is allocated for them.
  auto huge = metadata;
  huge.tensors.at("model.w3").size = {int64_t{1} << 40};
  huge.tensors.at("model.w3").chunks.resize(1);
  huge.tensors.at("model.w3").chunks.at(0).offsets = {0};
  huge.tensors.at("model.w3").chunks.at(0).sizes = {int64_t{1} << 40};
  const auto huge_dir = copy_of("huge");
  dcp::write_metadata(huge_dir, huge);
  BOOST_TEST(contains(read_error(huge_dir), "but its box of size [1099511627776] of "));
  BOOST_TEST(contains(read_error(huge_dir), "; expected an item that holds its box"));
  // The metadata names a file that is not there, or one outside the directory.
  auto elsewhere = metadata;
  elsewhere.tensors.at("model.w3").chunks.at(0).relative_path = "__7_0.distcp";
  const auto absent = copy_of("absent");
  dcp::write_metadata(absent, elsewhere);
  BOOST_TEST(contains(read_error(absent), (absent / "__7_0.distcp").string() + ", which " + (absent / ".metadata").string() +
                                               " names for model.w3, does not exist"));
  elsewhere.tensors.at("model.w3").chunks.at(0).relative_path = "../ck/__0_0.distcp";
  dcp::write_metadata(absent, elsewhere);
  BOOST_TEST(contains(read_error(absent), "expected a file name in the checkpoint's directory"));
  // An item that is not a tensor (the bytes value's), one that is no archive, of another dtype or shape.
  const auto& bytes = metadata.bytes.at("extra.count");
  auto retarget = [&](const std::string& name, auto&& change) {
    auto changed = metadata;
    change(changed.tensors.at("model.scalar"), changed.tensors.at("model.scalar").chunks.at(0));
    const auto directory = copy_of(name);
    dcp::write_metadata(directory, changed);
    return read_error(directory);
  };
  const auto not_tensor = retarget("not_tensor", [&](dcp::TensorEntry&, dcp::StoredChunk& chunk) {
    chunk.relative_path = bytes.relative_path;
    chunk.offset = bytes.offset;
    chunk.length = bytes.length;
  });
  BOOST_TEST(contains(not_tensor, "__1_0.distcp's item at bytes "));
  BOOST_TEST(contains(not_tensor, "holds an int of 0 storages; expected one tensor"));
  const auto not_archive = retarget("not_archive", [&](dcp::TensorEntry&, dcp::StoredChunk& chunk) { chunk.offset += 1; });
  BOOST_TEST(contains(not_archive, "is truncated or corrupt (a zip archive at bytes "));
  const auto dtype = retarget("dtype", [&](dcp::TensorEntry& entry, dcp::StoredChunk&) { entry.dtype = torch::kDouble; });
  BOOST_TEST(contains(dtype, "holds a Float tensor of size [] for model.scalar; expected Double of size []"));
  auto reshaped = metadata;
  auto& w1 = reshaped.tensors.at("model.w1");
  std::swap(w1.size[0], w1.size[1]);
  for (auto& chunk : w1.chunks) {
    std::swap(chunk.offsets[0], chunk.offsets[1]);
    std::swap(chunk.sizes[0], chunk.sizes[1]);
  }
  const auto shape_dir = copy_of("shape");
  dcp::write_metadata(shape_dir, reshaped);
  BOOST_TEST(contains(read_error(shape_dir), "holds a Float tensor of size [2, 7] for model.w1; expected Float of size [7, 2]"));
  // Chunks that overlap, or leave elements out.
  auto overlapping = metadata;
  overlapping.tensors.at("model.w3").chunks.at(1).offsets = {0};
  const auto overlap_dir = copy_of("overlap");
  dcp::write_metadata(overlap_dir, overlapping);
  BOOST_TEST(contains(read_error(overlap_dir), "the tensor model.w3 has chunks that overlap"));
  BOOST_TEST(contains(error_of([&] { dcp::merge_metadata({overlapping}); }), "the tensor model.w3 has chunks that overlap"));
  auto partial = metadata;
  partial.tensors.at("model.w4").chunks.pop_back();
  BOOST_TEST(contains(error_of([&] { dcp::merge_metadata({partial}); }), "the tensor model.w4 has chunks of "));
  const auto gap = copy_of("gap");
  dcp::write_metadata(gap, partial);
  BOOST_TEST(contains(read_error(gap), (gap / ".metadata").string() + ": the tensor model.w4 has chunks of "));
  BOOST_TEST(contains(read_error(gap), "; expected every element stored"));
  BOOST_TEST(contains(error_of([&] { dcp::parse_metadata(dcp::metadata_pickle(partial), "a part", false); }), "<no trainloop::Error"));
  BOOST_TEST(contains(error_of([&] { dcp::parse_metadata(dcp::metadata_pickle(overlapping), "a part", false); }),
                      "a part: the tensor model.w3 has chunks that overlap"));
  auto other_size = metadata;
  other_size.tensors.at("model.w2").size = {4, 6};
  BOOST_TEST(contains(error_of([&] { dcp::merge_metadata({metadata, other_size}); }),
                      "the DCP parts disagree on the tensor model.w2: part 1 has BFloat16 of size [4, 6]"));
}

BOOST_AUTO_TEST_CASE(crafted_items_are_refused_before_their_claims_are_allocated) {
  TempDir dir;
  const std::string four_floats(16, '\0');
  // A storage on a GPU; a view of 10^12 elements (stride 0) of a 4-element storage; a view past
  // its storage; a storage record of another size; a pickle that is not a tensor.
  const auto cuda = one_item_checkpoint(dir.path / "cuda", archive_of(Pickle().tensor(4, 0, {4}, {1}, "cuda:0").stop(), four_floats), {4});
  BOOST_TEST(contains(read_error(dir.path / "cuda"), "a storage located at \"cuda:0\"; expected \"cpu\""));
  one_item_checkpoint(dir.path / "bomb", archive_of(Pickle().tensor(4, 0, {1000000, 1000000}, {0, 0}).stop(), four_floats), {1000000, 1000000});
  // ...refused by the metadata's check, before the item is opened: its box needs 4 TB, its item has a few hundred bytes.
  BOOST_TEST(contains(read_error(dir.path / "bomb"), "but its box of size [1000000, 1000000] of Float needs 4000000000000"));
  one_item_checkpoint(dir.path / "past", archive_of(Pickle().tensor(4, 2, {4}, {1}).stop(), four_floats), {4});
  BOOST_TEST(contains(read_error(dir.path / "past"), "reaches past its storage of 4 elements"));
  one_item_checkpoint(dir.path / "short", archive_of(Pickle().tensor(8, 0, {8}, {1}).stop(), four_floats), {8});
  BOOST_TEST(contains(read_error(dir.path / "short"), "has 16 bytes for 8 Float elements; expected 32"));
  one_item_checkpoint(dir.path / "gadget", archive_of(Pickle().global("os", "system").text("touch pwned").op('\x85').op('R').stop(), ""), {4});
  const auto gadget = read_error(dir.path / "gadget");
  BOOST_TEST(contains(gadget, (dir.path / "gadget" / "__0_0.distcp").string()));
  BOOST_TEST(contains(gadget, "the global \"os.system\""));
  // A BOOL item with a byte other than 0 or 1 (undefined behaviour in libtorch's kernels): refused by
  // the chunk's read and the flat-range read alike, as the safetensors reader refuses it.
  one_item_checkpoint(dir.path / "bools", archive_of(Pickle().tensor(4, 0, {4}, {1}, "cpu", "BoolStorage").stop(), std::string("\1\0\7\1", 4)),
                      {4}, torch::kBool);
  BOOST_TEST(contains(read_error(dir.path / "bools"), "is a BOOL tensor holding byte 7 at storage element 2; expected 0 or 1"));
  dcp::DistcpReader bools(dir.path / "bools", dcp::read_metadata(dir.path / "bools"));
  BOOST_TEST(contains(error_of([&] { bools.read_flat_range(dcp::read_metadata(dir.path / "bools").tensors.at("t"), 2, 3); }),
                      "holding byte 7 at storage element 2"));
  // A transposed view (as Python saves base.t()) is read in its own order.
  one_item_checkpoint(dir.path / "transposed", archive_of(Pickle().tensor(6, 0, {3, 2}, {1, 3}).stop(), [] {
    std::string floats;
    for (float value : {0.f, 1.f, 2.f, 3.f, 4.f, 5.f}) floats.append(reinterpret_cast<const char*>(&value), sizeof value);
    return floats;
  }()), {3, 2});
  const auto metadata = dcp::read_metadata(dir.path / "transposed");
  dcp::DistcpReader reader(dir.path / "transposed", metadata);
  BOOST_TEST(torch::equal(reader.read_flat_range(metadata.tensors.at("t"), 1, 5), torch::tensor({3.f, 1.f, 4.f, 2.f})));
}

BOOST_AUTO_TEST_CASE(bad_metadata_is_a_clear_error_and_runs_no_code) {
  TempDir dir;
  const auto metadata_path = (dir.path / ".metadata").string();
  BOOST_TEST(contains(error_of([&] { dcp::read_metadata(dir.path); }), metadata_path + " does not exist"));
  auto with_metadata = [&](const std::string& bytes) {
    write_bytes(dir.path / ".metadata", bytes);
    return error_of([&] { dcp::read_metadata(dir.path); });
  };
  // Code: os.system, builtins.eval, getattr of anything but the memory-format enum; nothing runs.
  const auto system = with_metadata(Pickle().global("os", "system").text("touch " + (dir.path / "pwned").string()).op('\x85').op('R').stop());
  BOOST_TEST(contains(system, metadata_path));
  BOOST_TEST(contains(system, "the global \"os.system\"; expected only the names torch.distributed.checkpoint's .metadata uses"));
  BOOST_TEST(contains(with_metadata(Pickle().global("builtins", "eval").text("1+1").op('\x85').op('R').stop()), "the global \"builtins.eval\""));
  BOOST_TEST(contains(with_metadata(Pickle().global("builtins", "getattr").global("torch", "Size").text("__init__").op('\x86').op('R').stop()),
                      "expected nothing else of getattr"));
  BOOST_TEST(!fs::exists(dir.path / "pwned"));
  // Not DCP's Metadata, cut short, garbage, a tensor pickle.
  BOOST_TEST(contains(with_metadata(Pickle().integer(3).stop()), "has a root that is an int; expected a torch.distributed.checkpoint.metadata.Metadata"));
  dcp::Metadata small;
  small.bytes["x"] = {"x", "__0_0.distcp", 0, 1};
  const std::string good = dcp::metadata_pickle(small);
  BOOST_TEST(contains(with_metadata(good.substr(0, good.size() / 2)), "is not a pickle of DCP's Metadata (at byte "));
  BOOST_TEST(contains(with_metadata("not a pickle"), "is not a pickle of DCP's Metadata"));
  BOOST_TEST(contains(with_metadata(Pickle().tensor(4, 0, {4}, {1}).stop()), "the global \"torch._utils._rebuild_tensor_v2\""));
  // A stranger's key in a message is escaped and cut: a 100,000-byte name with a terminal escape.
  dcp::Metadata long_name;
  const std::string name = "\x1b[2J" + std::string(100000, 'k');
  long_name.tensors[name] = {name, torch::kFloat, {2}, false, {{{0}, {3}, "__0_0.distcp", 0, 1}}};
  const auto long_error = error_of([&] { dcp::parse_metadata(dcp::metadata_pickle(long_name), "long"); });
  BOOST_TEST(contains(long_error, "long: the tensor \\x1b[2Jkkk"));
  BOOST_TEST(long_error.size() < 1000u);
  // The whole pickle is fine, but its file is not there.
  BOOST_TEST(contains(with_metadata(good), (dir.path / "__0_0.distcp").string() + ", which " + metadata_path + " names for x, does not exist"));
}
