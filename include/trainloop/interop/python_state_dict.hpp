#pragma once
/// @file
/// @brief State_dict files of Python: reading what `torch.save(model.state_dict(), path)` wrote,
/// and writing a file that Python's `torch.load(path)` returns as a dict of name -> tensor.
///
/// The file is torch.save's zip format (the default since PyTorch 1.6): `<dir>/data.pkl`, a
/// pickle of the dict whose tensors refer to storages by key, `<dir>/data/<key>`, each storage's
/// raw bytes, and `<dir>/version` (the top folder is "archive" or the file's stem, depending on
/// the writer). libtorch's caffe2::serialize::PyTorchStreamReader/Writer handle the zip; the
/// pickle is read by serialization/pickle/pickle_reader.hpp (libtorch's Unpickler cannot, see there) and
/// written by libtorch's Pickler.

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/interop/state_dict.hpp>
#include <trainloop/serialization/archive/torch_archive.hpp>

#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>

namespace trainloop::interop {

namespace detail {

using trainloop::detail::concat;
using serialization::first_line;

/// What every "not a state_dict" message ends with.
inline constexpr const char* kExpectedPythonFile =
    "expected a file written by Python's torch.save(model.state_dict(), path) (the zip format, PyTorch >= 1.6)";

/// Opens `path` as a torch archive, naming it "state_dict file" in messages; see
/// serialization::TorchArchive (nothing in the file is trusted: sizes are checked before reading).
inline serialization::TorchArchive open_archive(const std::filesystem::path& path) {
  return serialization::TorchArchive(path, kExpectedPythonFile, "state_dict file ");
}

/// The (name, tensor) pairs of a state_dict pickle's root dict; `fail` names the file.
template <class Fail>
StateDict state_dict_of(const serialization::PickleDocument& document, Fail&& fail) {
  using Kind = serialization::PickleValue::Kind;
  const auto& root = document.root;
  if (root.kind != Kind::Dict) {
    throw fail(concat("holds ", serialization::a_kind(root.kind), "; expected a dict of name -> tensor (a state_dict)"));
  }
  StateDict state;
  const auto& items = document.items(root);
  for (size_t i = 0; i + 1 < items.size(); i += 2) {
    const auto& key = items[i];
    const auto& value = items[i + 1];
    if (key.kind != Kind::String) throw fail(concat("has ", serialization::a_kind(key.kind), " key; expected names"));
    const std::string& name = document.text(key);
    if (value.kind != Kind::Tensor) {
      throw fail(concat("holds ", serialization::a_kind(value.kind), " under ", serialization::quote_untrusted(name), "; expected a tensor (a ",
                        "state_dict itself, not a dict around it such as {'model': model.state_dict(), ...})"));
    }
    state.emplace_back(name, document.tensor(value));
  }
  return state;
}

/// Reads the state_dict of an open torch.save archive (see open_archive()).
inline StateDict read_state_dict_archive(serialization::TorchArchive& archive) {
  const auto document = archive.read_pickle("data.pkl", serialization::PickleFlavor::StateDict);
  return state_dict_of(document, [&](const std::string& what) {
    return CheckpointError(concat("trainloop: state_dict file ", archive.path().string(), " ", what));
  });
}

/// The tensors to write: detached, on the CPU (so Python loads them without a GPU), tensors that
/// shared one storage still sharing one (each storage is copied once, views are kept as views),
/// and each storage of one dtype (a second dtype viewing it is written as a copy).
inline StateDict cpu_state(const StateDict& state) {
  StateDict out;
  std::unordered_map<const void*, torch::Tensor> copies;  // storage -> its CPU copy, 1-d
  for (const auto& [name, tensor] : state) {
    TRAINLOOP_CHECK(tensor.defined() && tensor.layout() == torch::kStrided && !tensor.is_quantized(), "the tensor '",
                    name, "' is undefined, sparse or quantized; expected dense tensors to save as a state_dict");
    const torch::Tensor t = tensor.detach();
    auto& copy = copies[t.storage().unsafeGetStorageImpl()];
    if (!copy.defined()) copy = torch::empty({0}, t.options()).set_(t.storage()).to(torch::kCPU);
    if (copy.scalar_type() != t.scalar_type()) {
      out.emplace_back(name, t.to(torch::kCPU).clone());
    } else {
      out.emplace_back(name, copy.as_strided(t.sizes(), t.strides(), t.storage_offset()));
    }
  }
  return out;
}

}  // namespace detail

/// @brief Reads a state_dict that Python saved with `torch.save(model.state_dict(), path)`.
/// Safe on a file from a stranger: nothing in it runs, every size in it is checked before
/// anything is allocated for it (serialization/archive/torch_archive.hpp).
///
/// Every dtype torch.save writes as a typed storage is read (float, double, half, bfloat16,
/// int64, int32, int16, int8, uint8, bool, complex). Tensors come out on the CPU whatever device
/// they were saved from, without requires_grad, and as Python had them: tensors that viewed one
/// storage (tied weights, slices) are views of one storage again.
/// @param path the file
/// @return the (name, tensor) pairs in the file's order
/// @throws trainloop::CheckpointError naming the path when the file is missing, not torch.save's
///         zip format (a legacy torch.save file, a TorchScript archive, anything else), not a
///         dict of tensors, or corrupt; libtorch's own exception, if any, is nested in it.
inline StateDict read_python_state_dict(const std::filesystem::path& path) {
  auto archive = detail::open_archive(path);
  if (archive.is_torchscript()) {
    throw CheckpointError(trainloop::detail::concat(
        "trainloop: ", path.string(), " is a TorchScript archive (torch.jit.save, torch::save, or a trainloop checkpoint, ",
        "which load_state_dict() reads); ", detail::kExpectedPythonFile));
  }
  return detail::read_state_dict_archive(archive);
}

/// @brief Writes `state` as Python's torch.save would: `torch.load(path)` in Python returns a dict
/// of name -> tensor (on the CPU), which `model.load_state_dict()` accepts. Also with PyTorch
/// >= 2.6's default `weights_only=True`: the file names no global but the tensor-rebuilding ones.
///
/// Written atomically: a reader, or a crash, sees the previous file or the complete new one.
/// @param state the (name, tensor) pairs; tensors may be on any device and may share storage
/// @param path the file to write
/// @throws trainloop::CheckpointError naming the path when it cannot be written (libtorch's
///         exception nested); trainloop::ConfigurationError for a sparse or undefined tensor.
inline void save_python_state_dict(const StateDict& state, const std::filesystem::path& path) {
  const StateDict cpu = detail::cpu_state(state);
  c10::Dict<std::string, at::Tensor> dict;  // keeps insertion order
  for (const auto& [name, tensor] : cpu) dict.insert_or_assign(name, tensor);
  trainloop::detail::BasicAtomicFile<CheckpointError> file(path, "the state_dict file");
  try {
    // libtorch's Pickler writes what Python's torch.save writes for a dict of tensors (storages
    // by persistent id, torch._utils._rebuild_tensor_v2). tag_aggregates=false: no
    // torch.jit._pickle.restore_type_tag around the dict, which torch::pickle_save adds and
    // Python >= 2.6's torch.load(weights_only=True) refuses.
    std::string pickle;
    torch::jit::Pickler pickler([&](const char* data, size_t size) { pickle.append(data, size); }, nullptr, nullptr,
                                nullptr, nullptr, /*tag_aggregates=*/false);
    pickler.protocol();
    pickler.pushIValue(dict);
    pickler.stop();
    caffe2::serialize::PyTorchStreamWriter writer(file.writer());
    const auto& storages = pickler.tensorData();  // storage i is the pickle's key "i"
    for (size_t i = 0; i < storages.size(); ++i) {
      const auto data = torch::jit::getWriteableTensorData(storages[i]);
      writer.writeRecord("data/" + std::to_string(i), data.data(), data.sizeInBytes());
    }
    writer.writeRecord("data.pkl", pickle.data(), pickle.size());
    writer.writeEndOfFile();
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(trainloop::detail::concat(
        "trainloop: cannot write the state_dict file ", path.string(), ": ", detail::first_line(error),
        "; expected a writable directory with free space (the previous file, if any, is unchanged)")));
  }
  file.commit();
}

/// @brief Writes the model's parameters and buffers (module_state_dict()) as Python's
/// `torch.save(model.state_dict(), path)` would; see save_python_state_dict(const StateDict&, const std::filesystem::path&).
/// @param module the model; its tensors are read, not changed
/// @param path the file to write
inline void save_python_state_dict(const torch::nn::Module& module, const std::filesystem::path& path) {
  save_python_state_dict(module_state_dict(module), path);
}

}  // namespace trainloop::interop
