#pragma once
/// @file
/// @brief What the objects of a pickle become, done in C++ for serialization/pickle/pickle_reader.hpp's
/// unpickler: a global checked against the allow-list (pickle_globals.hpp) the moment it is named,
/// REDUCE of an allowed callable (an OrderedDict, a tensor proved inside its storage, a
/// parameter's data), the storages that persistent ids name (each loaded once), BUILD's state,
/// and NEWOBJ of a TorchScript class. No method of any class runs.

#include <trainloop/serialization/pickle/pickle_builder.hpp>
#include <trainloop/serialization/pickle/pickle_globals.hpp>
#include <trainloop/serialization/pickle/pickle_limits.hpp>
#include <trainloop/serialization/pickle/pickle_value.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/serialization/pickle/tensor_rebuild.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <iterator>
#include <vector>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>

namespace trainloop::serialization {

/// @brief Loads storage `key` (`data/<key>` in the archive) of `numel` elements of `dtype`, as a
/// 1-d tensor; it must prove the record holds exactly numel * itemsize bytes.
using StorageLoader = std::function<torch::Tensor(const std::string& key, torch::ScalarType dtype, int64_t numel)>;

/// @brief Makes the objects of one pickle (see the file comment) into its PickleDocument; the
/// unpickler (Unpickler) runs the opcodes and hands it their operands.
class PickleObjects : protected PickleBuilder {
 protected:
  /// @param limits the bounds the pickle is held to
  /// @param flavor which globals it may name
  /// @param load_storage reads a storage the pickle refers to by persistent id
  PickleObjects(PickleLimits limits, PickleFlavor flavor, StorageLoader load_storage)
      : PickleBuilder(limits), flavor_(flavor), load_storage_(std::move(load_storage)) {}

  /// Throws PickleError with the streamed message parts (the unpickler adds where).
  template <class... Parts>
  [[noreturn]] static void fail(Parts&&... parts) {
    pickle_fail(std::forward<Parts>(parts)...);
  }

  /// Refuses every storage whose persistent id names another location than `location` ("cpu").
  void require_storage_location(std::string location) { required_location_ = std::move(location); }

  /// GLOBAL, STACK_GLOBAL: `module.name`, if the allow-list has it for this flavor.
  PickleValue global(std::string_view module, std::string_view name) {
    const auto role = allowed_global(module, name, flavor_);
    if (!role) {
      if (flavor_ == PickleFlavor::DcpMetadata) {
        fail("the pickle names the global ", quote_untrusted(std::string(module) + "." + std::string(name)), "; ", kAllowedDcpGlobals);
      }
      fail("the pickle names the global ", quote_untrusted(std::string(module) + "." + std::string(name)), ", which a file of weights never needs; ", kAllowedGlobals);
    }
    PickleValue value = make_text(Kind::Global, std::string(module) + "." + std::string(name));
    value.integer = static_cast<int64_t>(*role);
    return value;
  }
  /// What the allowed global `global` is for.
  static GlobalRole role_of(const PickleValue& global) { return static_cast<GlobalRole>(global.integer); }

  /// REDUCE: what the allowed global `callable` returns for `args`, done here.
  PickleValue call(const PickleValue& callable, const PickleValue& args) {
    if (callable.kind != Kind::Global) fail("REDUCE of ", a_kind(callable.kind), "; expected a global");
    if (args.kind != Kind::Tuple) fail("REDUCE with ", a_kind(args.kind), "; expected a tuple");
    const auto& list = document_.items(args);
    const auto& name = document_.text(callable);
    switch (role_of(callable)) {
      case GlobalRole::OrderedDict: {
        if (!list.empty()) fail(name, " called with ", list.size(), " arguments; expected ()");
        PickleValue dict = make_container(Kind::Dict, {});
        dict.integer = 1;  // takes state (BUILD), as an OrderedDict does
        return dict;
      }
      case GlobalRole::RebuildTensor: {
        if (list.size() < 4 || list[0].kind != Kind::Storage || list[1].kind != Kind::Int) {
          fail(name, " with arguments other than (storage, offset, size, stride, ...)");
        }
        auto size = int_tuple(document_, list[2], "a tensor's size", limits_.max_dims);
        auto stride = int_tuple(document_, list[3], "a tensor's stride", limits_.max_dims);
        return make_tensor(Kind::Tensor, rebuild_tensor_view(document_.tensor(list[0]), list[1].integer, size, stride));
      }
      case GlobalRole::RebuildParameter:
        // (data, requires_grad, backward_hooks[, state]): the data is all a state_dict needs.
        if (list.empty() || list[0].kind != Kind::Tensor) fail(name, " of ", list.empty() ? "nothing" : a_kind(list[0].kind), "; expected a tensor");
        return list[0];
      case GlobalRole::FirstArgument:
        if (list.empty()) fail(name, " of nothing; expected a value");
        return list[0];
      case GlobalRole::TorchSize:  // torch.Size((2, 3)): the tuple itself
        if (list.size() != 1 || list[0].kind != Kind::Tuple) fail(name, " of other than one tuple; expected torch.Size((ints...))");
        int_tuple(document_, list[0], "a torch.Size", limits_.max_dims);
        return list[0];
      case GlobalRole::Layout:  // torch.serialization._get_layout("torch.strided"): the name
        if (list.size() != 1 || list[0].kind != Kind::String) fail(name, " of other than one str; expected a layout's name");
        return list[0];
      case GlobalRole::FilePath:  // pathlib.PosixPath("/", "a", "b"): the parts' text, joined
        return path_text(name, list);
      case GlobalRole::MemoryFormatEnum:  // _MEM_FORMAT_ENCODING(0): the member's value
        if (list.size() != 1 || list[0].kind != Kind::Int || list[0].integer < 0 ||
            list[0].integer >= static_cast<int64_t>(std::size(kMemoryFormatMembers))) {
          fail(name, " of other than a member's value; expected 0, 1 or 2");
        }
        return list[0];
      case GlobalRole::EnumMember:  // getattr(_MEM_FORMAT_ENCODING, "TORCH_..."): Python 3.11's pickle of a member
        if (list.size() == 2 && list[0].kind == Kind::Global && role_of(list[0]) == GlobalRole::MemoryFormatEnum &&
            list[1].kind == Kind::String) {
          for (size_t member = 0; member < std::size(kMemoryFormatMembers); ++member) {
            if (document_.text(list[1]) == kMemoryFormatMembers[member]) {
              PickleValue value;
              value.kind = Kind::Int;
              value.integer = static_cast<int64_t>(member);
              return value;
            }
          }
        }
        fail(name, " of other than _MEM_FORMAT_ENCODING and one of its members' names; expected nothing else of getattr");
      default:
        fail("the pickle calls ", name, ", which is not callable here; ", kAllowedGlobals);
    }
  }

  /// BINPERSID: a storage, loaded once per key, so that tensors viewing one storage share it as
  /// in Python.
  PickleValue persistent_load(const PickleValue& id) {
    const auto* fields = id.kind == Kind::Tuple ? &document_.items(id) : nullptr;
    if (fields == nullptr || fields->size() != 5 || (*fields)[0].kind != Kind::String ||
        document_.text((*fields)[0]) != "storage" || (*fields)[1].kind != Kind::Global ||
        role_of((*fields)[1]) != GlobalRole::StorageType || (*fields)[2].kind != Kind::String ||
        (*fields)[4].kind != Kind::Int || (*fields)[4].integer < 0) {
      fail("a persistent id that is not ('storage', torch.<Type>Storage, key, location, numel >= 0)");
    }
    if (!required_location_.empty() &&
        ((*fields)[3].kind != Kind::String || document_.text((*fields)[3]) != required_location_)) {
      fail("a storage located at ", (*fields)[3].kind == Kind::String ? quote_untrusted(document_.text((*fields)[3])) : a_kind((*fields)[3].kind),
           "; expected ", quote_untrusted(required_location_));
    }
    const auto dtype = *storage_dtype(document_.text((*fields)[1]));
    const std::string& key = document_.text((*fields)[2]);
    const int64_t numel = (*fields)[4].integer;
    auto found = storages_.find(key);
    if (found == storages_.end()) {
      const torch::Tensor storage = load_storage_(key, dtype, numel);
      found = storages_.emplace(key, make_tensor(Kind::Storage, storage)).first;
    }
    const auto& loaded = document_.tensor(found->second);
    if (loaded.scalar_type() != dtype || loaded.numel() != numel) {
      fail("storage ", quote_untrusted(key), " is named as ", numel, " elements of ", dtype, " and as ", loaded.numel(), " of ",
           loaded.scalar_type(), "; expected one type per storage");
    }
    return found->second;
  }

  /// BUILD: gives `target` (the value on top of the stack) its `state`.
  void build(const PickleValue& target, const PickleValue& state) {
    switch (target.kind) {
      case Kind::Object: {
        // A TorchScript object's attributes, by name; a DCP dataclass's state (TensorProperties'
        // __getstate__ is a tuple). No method of its class runs.
        const bool dcp = role_of(document_.items(target)[0]) == GlobalRole::DcpClass;
        if (state.kind != Kind::Dict && !(dcp && state.kind == Kind::Tuple)) {
          fail("BUILD of ", a_kind(state.kind), " on an object; expected a dict of attributes");
        }
        if (document_.items(target)[1].kind != Kind::None) fail("BUILD on an object that has its attributes; expected one BUILD");
        set_object_state(target, state);
        break;
      }
      case Kind::Dict:
        // An OrderedDict's `_metadata` (each module's version, which Python's load_state_dict
        // hands to _load_from_state_dict): it says nothing about the values.
        if (target.integer != 1) fail("BUILD on a dict that is not an OrderedDict; expected BUILD only on an OrderedDict");
        if (state.kind != Kind::Dict && state.kind != Kind::None) fail("BUILD of ", a_kind(state.kind), " on an OrderedDict; expected a dict");
        break;
      case Kind::Tensor:
        if (state.kind != Kind::Dict && state.kind != Kind::None) fail("BUILD of ", a_kind(state.kind), " on a tensor; expected a dict");
        break;
      default:
        fail("BUILD on ", a_kind(target.kind), "; expected one on an OrderedDict, a tensor or a TorchScript object");
    }
  }

  /// NEWOBJ: `cls.__new__(cls, *args)`, how a TorchScript object is pickled; an object without
  /// attributes until its BUILD.
  PickleValue new_object(const PickleValue& cls, const PickleValue& args) {
    if (cls.kind != Kind::Global || (role_of(cls) != GlobalRole::ScriptClass && role_of(cls) != GlobalRole::DcpClass)) {
      fail("the pickle creates an object of ", cls.kind == Kind::Global ? quote_untrusted(document_.text(cls)) : std::string(a_kind(cls.kind)),
           "; expected objects only of TorchScript classes (__torch__.*) in a TorchScript archive, or of DCP's "
           "metadata classes in a .metadata");
    }
    if (args.kind != Kind::Tuple || !document_.items(args).empty()) fail("NEWOBJ of ", quote_untrusted(document_.text(cls)), " with arguments; expected ()");
    return make_container(Kind::Object, {cls, PickleValue{}});
  }

 private:
  /// pathlib's `PurePath.__reduce__` is (cls, parts): the parts joined by '/' (the first, a root
  /// "/", stands alone), as text; no path is touched.
  PickleValue path_text(const std::string& name, const std::vector<PickleValue>& parts) {
    std::string text;
    for (const auto& part : parts) {
      if (part.kind != Kind::String) fail(name, " of ", a_kind(part.kind), "; expected strs");
      const std::string& piece = document_.text(part);
      if (!text.empty() && text.back() != '/') text += '/';
      // Bounded before it grows: a path of memoized parts repeated could ask for any size.
      if (piece.size() > kMaxPathBytes || text.size() > kMaxPathBytes - piece.size()) fail(name, " of more than ", kMaxPathBytes, " bytes");
      text += piece;
    }
    return make_text(Kind::String, text);
  }

  static constexpr size_t kMaxPathBytes = 65536;  // Linux's PATH_MAX is 4096

  PickleFlavor flavor_;
  StorageLoader load_storage_;
  std::string required_location_;  // "" for any
  std::unordered_map<std::string, PickleValue> storages_;  // key -> its Storage value
};

}  // namespace trainloop::serialization
