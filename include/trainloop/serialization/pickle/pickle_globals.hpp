#pragma once
/// @file
/// @brief The allow-list of Python globals a weights file may name, checked when the pickle names
/// one (GLOBAL, STACK_GLOBAL) as Python's `torch.load(weights_only=True)` does, and what each does
/// here, in C++. Every other name is an error that names it: reading a file runs no code from it.
///
/// | name                                                    | role                              |
/// |---------------------------------------------------------|-----------------------------------|
/// | collections.OrderedDict                                 | `()` makes a dict; takes state (`_metadata`), ignored |
/// | torch._utils._rebuild_tensor_v2, _rebuild_tensor        | a view of a storage (tensor_rebuild.hpp) |
/// | torch._utils._rebuild_parameter, _with_state            | its data tensor                   |
/// | torch.FloatStorage ... torch.ComplexDoubleStorage       | a storage's dtype in a persistent id |
/// | torch.float32 ... (dtypes)                              | inert constants                   |
/// | TorchScript archives only: `__torch__.*` classes        | NEWOBJ `()` makes an object; BUILD gives it its attributes (a dict); no method of it runs |
/// | TorchScript archives only: torch.jit._pickle.build_*list, restore_type_tag | their first argument |
/// | DCP .metadata only: torch.distributed.checkpoint's dataclasses | NEWOBJ `()` makes an object; BUILD gives it its state (a dict, or TensorProperties' tuple) |
/// | DCP .metadata only: torch.Size, torch.serialization._get_layout, pathlib.*Path | the tuple; the layout's name; the path's text |
/// | DCP .metadata only: metadata._MEM_FORMAT_ENCODING, builtins.getattr of it | the member's value (`getattr` of nothing else) |

#include <trainloop/serialization/pickle/pickle_value.hpp>
#include <trainloop/serialization/pickle/tensor_rebuild.hpp>

#include <torch/torch.h>

#include <cctype>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace trainloop::serialization {

/// @brief Which pickles a reader takes: torch.save's, or also TorchScript archives' classes.
enum class PickleFlavor {
  StateDict,    ///< `torch.save(...)`: the state_dict names only
  TorchScript,  ///< `torch.jit.save`, `torch::save`, trainloop checkpoints: also `__torch__.*` objects
  DcpMetadata,  ///< torch.distributed.checkpoint's `.metadata`: its dataclasses, dtypes, no tensors
};

/// @brief What an allowed global is for.
enum class GlobalRole : int64_t {
  OrderedDict,        ///< collections.OrderedDict
  RebuildTensor,      ///< torch._utils._rebuild_tensor_v2, _rebuild_tensor
  RebuildParameter,   ///< torch._utils._rebuild_parameter, _rebuild_parameter_with_state
  StorageType,        ///< torch.FloatStorage ...
  DType,              ///< torch.float32 ...
  ScriptClass,        ///< __torch__.* (TorchScript archives)
  FirstArgument,      ///< torch.jit._pickle.build_intlist ..., restore_type_tag (TorchScript archives)
  DcpClass,           ///< torch.distributed.checkpoint's dataclasses (DCP .metadata)
  TorchSize,          ///< torch.Size: REDUCE of a tuple of ints gives that tuple (DCP .metadata)
  Layout,             ///< torch.serialization._get_layout: REDUCE of a name gives the name (DCP .metadata)
  FilePath,           ///< pathlib.PosixPath ...: REDUCE of parts gives their text (DCP .metadata)
  MemoryFormatEnum,   ///< metadata._MEM_FORMAT_ENCODING: REDUCE of a value gives the value (DCP .metadata)
  EnumMember,         ///< builtins.getattr, only of _MEM_FORMAT_ENCODING and a member's name (DCP .metadata)
};

/// The members of torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING, by value.
inline constexpr std::string_view kMemoryFormatMembers[] = {"TORCH_CONTIGUOUS_FORMAT", "TORCH_CHANNELS_LAST",
                                                            "TORCH_PRESERVE_FORMAT"};

/// @brief The role of a global a DCP `.metadata` pickle (torch 2.x's FileSystemWriter) may name:
/// the classes pickle.dump writes for its Metadata (which Python's reader loads with pickle.load,
/// so it names them), and the few torch and pathlib names their fields pickle to.
inline std::optional<GlobalRole> dcp_metadata_global(std::string_view module, std::string_view name) {
  if (module == "torch.distributed.checkpoint.metadata") {
    static constexpr std::string_view classes[] = {"Metadata",         "TensorStorageMetadata", "BytesStorageMetadata",
                                                   "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                                   "StorageMeta"};
    for (auto known : classes) {
      if (name == known) return GlobalRole::DcpClass;
    }
    if (name == "_MEM_FORMAT_ENCODING") return GlobalRole::MemoryFormatEnum;
  }
  if (module == "torch.distributed.checkpoint.filesystem" && name == "_StorageInfo") return GlobalRole::DcpClass;
  if (module == "torch" && name == "Size") return GlobalRole::TorchSize;
  if (module == "torch.serialization" && name == "_get_layout") return GlobalRole::Layout;
  if (module == "pathlib" && (name == "PosixPath" || name == "PurePosixPath" || name == "WindowsPath" ||
                              name == "PureWindowsPath" || name == "Path")) {
    return GlobalRole::FilePath;
  }
  if (module == "builtins" && name == "getattr") return GlobalRole::EnumMember;
  return std::nullopt;
}

/// The dtype of a storage class (`torch.FloatStorage` ...), or nullopt for another name.
inline std::optional<torch::ScalarType> storage_dtype(std::string_view global) {
  static constexpr std::pair<std::string_view, torch::ScalarType> classes[] = {
      {"torch.FloatStorage", torch::kFloat},   {"torch.DoubleStorage", torch::kDouble},
      {"torch.HalfStorage", torch::kHalf},     {"torch.BFloat16Storage", torch::kBFloat16},
      {"torch.LongStorage", torch::kLong},     {"torch.IntStorage", torch::kInt},
      {"torch.ShortStorage", torch::kShort},   {"torch.CharStorage", torch::kChar},
      {"torch.ByteStorage", torch::kByte},     {"torch.BoolStorage", torch::kBool},
      {"torch.ComplexFloatStorage", torch::kComplexFloat}, {"torch.ComplexDoubleStorage", torch::kComplexDouble}};
  for (const auto& [name, dtype] : classes) {
    if (global == name) return dtype;
  }
  return std::nullopt;
}

/// A TorchScript class name: `__torch__` and dotted identifiers after it.
inline bool is_script_class(std::string_view module, std::string_view name) {
  if (module != "__torch__" && module.substr(0, 10) != "__torch__.") return false;
  auto identifier_chars = [](std::string_view text) {
    if (text.empty()) return false;
    for (char c : text) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.')) return false;
    }
    return true;
  };
  return identifier_chars(module) && identifier_chars(name);
}

/// @brief The role of `module.name` if a pickle of `flavor` may name it.
inline std::optional<GlobalRole> allowed_global(std::string_view module, std::string_view name, PickleFlavor flavor) {
  if (flavor == PickleFlavor::DcpMetadata) {
    // No tensors, storages or OrderedDicts: only the dtypes below and DCP's own names.
    if (auto role = dcp_metadata_global(module, name)) return role;
  }
  if (flavor != PickleFlavor::DcpMetadata && module == "collections" && name == "OrderedDict") return GlobalRole::OrderedDict;
  if (flavor != PickleFlavor::DcpMetadata && module == "torch._utils") {
    if (name == "_rebuild_tensor_v2" || name == "_rebuild_tensor") return GlobalRole::RebuildTensor;
    if (name == "_rebuild_parameter" || name == "_rebuild_parameter_with_state") return GlobalRole::RebuildParameter;
  }
  if (module == "torch") {
    if (flavor != PickleFlavor::DcpMetadata && storage_dtype(std::string("torch.") + std::string(name))) return GlobalRole::StorageType;
    static constexpr std::string_view dtypes[] = {"float32", "float",   "float64", "double",  "float16", "half",
                                                  "bfloat16", "int64",  "long",    "int32",   "int",     "int16",
                                                  "short",   "int8",    "uint8",   "bool",    "complex64",
                                                  "complex128"};
    for (auto dtype : dtypes) {
      if (name == dtype) return GlobalRole::DType;
    }
  }
  if (flavor == PickleFlavor::TorchScript) {
    if (is_script_class(module, name)) return GlobalRole::ScriptClass;
    if (module == "torch.jit._pickle" &&
        (name == "build_intlist" || name == "build_doublelist" || name == "build_boollist" ||
         name == "build_tensorlist" || name == "restore_type_tag")) {
      return GlobalRole::FirstArgument;
    }
  }
  return std::nullopt;
}

/// What every refused global's message ends with.
inline constexpr const char* kAllowedGlobals =
    "expected only the names a file of weights uses (collections.OrderedDict, torch._utils._rebuild_tensor_v2, "
    "_rebuild_parameter, torch.*Storage, dtypes; reading a weights file runs no code from it)";
/// What a refused global of a DCP `.metadata` pickle is told instead.
inline constexpr const char* kAllowedDcpGlobals =
    "expected only the names torch.distributed.checkpoint's .metadata uses (its metadata dataclasses, "
    "filesystem._StorageInfo, torch.Size, dtypes, layouts, pathlib paths; reading it runs no code from it)";

}  // namespace trainloop::serialization
