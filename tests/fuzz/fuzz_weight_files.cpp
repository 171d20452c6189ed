// libFuzzer target over every reader of weight files from strangers (include/trainloop/serialization/):
// the low four bits of an input's first byte (the selector) pick what the rest is, through the
// table kReaders at the end of this file:
//   0: a pickle read as torch.save's data.pkl, storages of up to 2^16 elements made in memory;
//   1: the same, read as a TorchScript archive's pickle (objects of __torch__ classes);
//   2: a whole file read as interop::load_state_dict reads one: the zip directory's checks,
//      TorchArchive, data.pkl with its storages read from the file's records;
//   3: a whole file read as a checkpoint or scripted model is: TorchArchive::check_runs_no_code()
//      (the zip directory, no code defining methods, every pickle libtorch will read within the
//      safe reader's limits) and, when that passes, libtorch's own torch::jit::load — what
//      TrainLoop::load_checkpoint and interop::ScriptModule do next. A crash there is a file the
//      check let through;
//   4, 7: a whole file read as interop::ExportedProgram reads a PT2 archive (torch.export.save):
//      the zip directory, the JSON program (schema, signature, nodes), every operator resolved
//      and every argument checked against its schema, the weights' sizes, strides and offsets;
//      then the program run forward and backward in train mode and forward in eval mode, as
//      training runs it (run_program; issue 50: the kernels a program calls are fuzzed too);
//   5: the same, with the input as the program's models/model.json in a valid archive (the tiny
//      program of tests/pt2_fixture.hpp), so mutations reach the graph checks at once;
//   6: the same, with the input as its data/weights/model_weights_config.json;
//   8: a whole .safetensors file read by SafetensorsFile: the header's checks, every tensor read,
//      and a flat element range of each;
//   9: a DCP .metadata pickle (torch.distributed.checkpoint): parse_metadata, every entry touched,
//      and what parsed written again (metadata_pickle) must parse to the same (fuzz_dcp.hpp);
//  10: a DCP .distcp tensor item (a torch.save blob) in a file, read as DistcpReader::read_chunk
//      reads it for a fixed entry (float32 [2, 3]) and as DistcpItem reads any tensor (fuzz_dcp.hpp);
//  11: a copy of a neighbour's shares as elastic training leaves it in /dev/shm (block, descriptor,
//      trailer), read as a keeper reads it after a loss and written as the lost rank's .distcp
//      file (fuzz_elastic.hpp);
//   12..15: not assigned yet; such inputs are ignored. A new reader takes the next free value (an
//      entry in kReaders and a line here); values never change meaning, so the corpus keeps its.
// (Selectors 0..7 were the low three bits before 8 came; the seeds of then all start below 8.)
// Then what a reader does with the result is done too: every tensor's bytes are read (so a view
// outside its storage is an ASan report, not a silent read).
//
// Built and run by the ctest test `fuzz_weight_files` (tests/fuzz/run_fuzz.cmake) with clang's
// -fsanitize=fuzzer,address; seeds: tests/fuzz/corpus (scripts/make-fuzz-corpus.py).
#include "../pt2_fixture.hpp"
#include "fuzz_dcp.hpp"
#include "fuzz_elastic.hpp"

#include <trainloop/serialization/export/export_graph.hpp>
#include <trainloop/interpreter/graph_program.hpp>
#include <trainloop/serialization/pickle/pickle_reader.hpp>
#include <trainloop/serialization/export/pt2_archive.hpp>
#include <trainloop/serialization/safetensors/safetensors_reader.hpp>
#include <trainloop/serialization/archive/torch_archive.hpp>

#include <torch/script.h>

#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace {

using namespace trainloop::serialization;

// Reads every byte of the storage that the tensor's elements span, without making anything of
// the size the view describes: a legal stride-0 view of 2^40 elements spans one element. (The
// first version summed tensor.to(kDouble), allocating numel * 8 bytes: 8 TiB for that view.)
void touch(const torch::Tensor& tensor) {
  if (tensor.numel() == 0 || tensor.device().type() != torch::kCPU) return;
  int64_t last = tensor.storage_offset();
  for (int64_t d = 0; d < tensor.dim(); ++d) last += (tensor.size(d) - 1) * tensor.stride(d);
  const auto item = static_cast<int64_t>(tensor.element_size());
  const auto* bytes = static_cast<const volatile unsigned char*>(tensor.storage().data());
  unsigned sum = 0;
  for (int64_t at = tensor.storage_offset() * item; at < (last + 1) * item; ++at) sum += bytes[at];
  static volatile unsigned sink = 0;
  sink = sink + sum;
}

void touch_document(const PickleDocument& document) {
  if (document.root.kind == PickleValue::Kind::Dict) {
    const auto& items = document.items(document.root);
    for (size_t i = 0; i + 1 < items.size(); i += 2) {
      if (items[i + 1].kind == PickleValue::Kind::Tensor) touch(document.tensor(items[i + 1]));
    }
  } else if (document.root.kind == PickleValue::Kind::Object) {
    for (const auto& [name, tensor] : module_tensors(document)) touch(tensor);
  }
}

/// The file an input is written to for the readers that take a path: one per fuzzing process,
/// removed when it exits.
const std::filesystem::path& scratch_file() {
  struct Scratch {
    std::filesystem::path path;
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove(path, ignored);
    }
  };
  static const Scratch scratch{[] {
    const std::filesystem::path shm = "/dev/shm";
    const auto dir = std::filesystem::is_directory(shm) ? shm : std::filesystem::temp_directory_path();
    return dir / ("trainloop-fuzz-" + std::to_string(::getpid()) + ".pt");
  }()};
  return scratch.path;
}

void read_pickle_bytes(std::string_view bytes, PickleFlavor flavor) {
  auto load_storage = [](const std::string&, torch::ScalarType dtype, int64_t numel) {
    if (numel > (int64_t{1} << 16)) throw PickleError("storage too large for the fuzzer");
    return torch::zeros({numel}, torch::TensorOptions().dtype(dtype));
  };
  PickleLimits limits;
  limits.max_value_bytes = size_t{64} << 20;  // the fuzzer's RSS limit is 2 GiB
  try {
    touch_document(Unpickler(bytes, flavor, load_storage, limits).run());
  } catch (const PickleError&) {
  }
}

void read_file_bytes(std::string_view bytes, bool as_torchscript) {
  const auto& path = scratch_file();
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    TorchArchive archive(path, "expected a file of weights", "fuzzed file ");
    if (!as_torchscript) {
      touch_document(archive.read_pickle("data.pkl", archive.is_torchscript() ? PickleFlavor::TorchScript : PickleFlavor::StateDict));
      return;
    }
    archive.check_runs_no_code();
  } catch (const trainloop::CheckpointError&) {
    return;  // refused with the error a user sees: what the readers promise
  }
  // Passed the check: libtorch reads it now, as a checkpoint or a scripted model would be read.
  // Its own errors (c10::Error) are fine; a crash is not.
  try {
    torch::jit::Module module = torch::jit::load(path.string());
    for (const auto& parameter : module.parameters()) touch(parameter);
  } catch (const c10::Error&) {
  } catch (const std::exception&) {
  }
}

/// Runs `program` as training does: a forward in train mode on an input of the sizes it was
/// exported with (a dynamic size at its range's low end, at least 2), the backward of its output,
/// then a forward in eval mode; under a 64 MiB memory budget (GraphProgram::run), inputs of at most
/// 4096 elements. An operator's error is a refusal; out-of-bounds reads and writes are ASan's.
void run_program(const ExportGraph& graph, const GraphProgram& program, std::map<std::string, torch::Tensor>& tensors) {
  std::vector<torch::Tensor> state;
  for (const auto& input : graph.inputs) {
    if (input.kind == ExportInput::Kind::UserInput) continue;
    const auto found = tensors.find(input.target);
    if (found == tensors.end()) return;  // ExportedProgram refuses such an archive at load
    torch::Tensor tensor = found->second.detach();
    if (input.kind == ExportInput::Kind::Parameter && tensor.is_floating_point()) tensor.requires_grad_(true);
    state.push_back(tensor);
  }
  std::vector<int64_t> sizes;
  int64_t numel = 1;
  for (const auto& dim : graph.input_dims) {
    int64_t size = dim.fixed ? *dim.fixed : 2;
    if (!dim.fixed && !dim.symbol.empty()) {
      const auto range = graph.ranges.find(dim.symbol);
      if (range != graph.ranges.end()) size = std::max<int64_t>(size, range->second.min);
    }
    if (size < 0 || size > 4096 || (size > 0 && numel > 4096 / size)) return;
    numel *= size;
    sizes.push_back(size);
  }
  const int64_t budget = int64_t{64} << 20;
  try {
    torch::manual_seed(0);
    const torch::Tensor output = program.run(state, torch::randn(sizes), /*eval=*/false, budget);
    if (output.requires_grad() && output.is_floating_point()) output.sum().backward();
    program.run(state, torch::randn(sizes), /*eval=*/true, budget);
  } catch (const trainloop::Error&) {
  } catch (const c10::Error&) {
  }
}

/// Reads the scratch file as interop::ExportedProgram does, short of registering the tensors in
/// a module: every program, its graph compiled against the dispatcher, every tensor read and
/// touched; then the program run (run_program).
void read_pt2_file() {
  try {
    Pt2Archive archive(scratch_file());
    for (const auto& name : archive.programs()) {
      const auto graph = read_export_graph(archive, name);
      const GraphProgram program(graph);
      std::map<std::string, torch::Tensor> tensors;
      for (const char* kind : {"weights", "constants"}) {
        const std::string directory = std::string("data/") + kind + "/";
        for (const auto& payload : archive.read_payloads(directory + name + "_" + kind + "_config.json", directory)) {
          touch(payload.tensor);
          tensors.emplace(payload.name, payload.tensor);
        }
      }
      run_program(graph, program, tensors);
    }
  } catch (const trainloop::CheckpointError&) {
  }
}

void read_pt2_bytes(std::string_view bytes) {
  std::ofstream(scratch_file(), std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  read_pt2_file();
}

/// The tiny program's archive with record `name` replaced by `bytes`.
void read_pt2_with_record(const std::string& name, std::string_view bytes) {
  static const pt2_fixture::Records base = pt2_fixture::tiny_records();
  auto records = base;
  records[name] = std::string(bytes);
  pt2_fixture::write_archive(scratch_file(), records);
  read_pt2_file();
}

void read_safetensors_bytes(std::string_view bytes) {
  std::ofstream(scratch_file(), std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  try {
    const SafetensorsFile file(scratch_file());
    for (const auto& entry : file.entries()) {
      touch(file.read(entry.name));
      const int64_t numel = entry.numel();
      touch(file.read_flat(entry.name, numel / 3, numel - numel / 4));
    }
  } catch (const trainloop::CheckpointError&) {
  }
}

/// What each selector (the first byte's low four bits) reads the rest of an input as; nullptr:
/// not assigned yet. See the table at the top of this file.
using Reader = void (*)(std::string_view);
constexpr Reader kReaders[16] = {
    [](std::string_view b) { read_pickle_bytes(b, PickleFlavor::StateDict); },                    // 0
    [](std::string_view b) { read_pickle_bytes(b, PickleFlavor::TorchScript); },                  // 1
    [](std::string_view b) { read_file_bytes(b, /*as_torchscript=*/false); },                     // 2
    [](std::string_view b) { read_file_bytes(b, /*as_torchscript=*/true); },                      // 3
    read_pt2_bytes,                                                                               // 4
    [](std::string_view b) { read_pt2_with_record("models/model.json", b); },                     // 5
    [](std::string_view b) { read_pt2_with_record("data/weights/model_weights_config.json", b); },  // 6
    read_pt2_bytes,                                                                               // 7
    read_safetensors_bytes,                                                                       // 8
    fuzz_dcp::fuzz_dcp_metadata,                                                                  // 9
    fuzz_dcp::fuzz_dcp_item,                                                                      // 10
    fuzz_elastic::fuzz_shared_copy,                                                               // 11
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view bytes(reinterpret_cast<const char*>(data + 1), size - 1);
  if (const Reader reader = kReaders[data[0] & 15]) reader(bytes);
  return 0;
}
