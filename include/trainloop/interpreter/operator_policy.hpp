#pragma once
/// @file
/// @brief Which operators a program from a file may run: a positive allow-list.
///
/// Being in libtorch's dispatcher is not enough: public ATen kernels trust their inputs more than a
/// stranger's graph deserves. An outside test (issue 50) drove them out of bounds from a .pt2:
/// `embedding_dense_backward` with indices out of range (SIGSEGV, heap corruption),
/// `segment_reduce(unsafe=True)`, `sparse_coo_tensor` + `to_dense`, pooling backwards with crafted
/// indices, `_scaled_dot_product_flash_attention_for_cpu` with mismatched batches; `.out` variants
/// resized a parameter around the `resize_` ban. So a program runs only operators on this list:
///
/// - **the list** (exported_operators.hpp) is every operator.overload that torch.export's training
///   IR emits, in train and in eval mode, for timm's four families, torchvision's classifiers,
///   trainloop's zoo as Python spells it and transformer blocks — derived by
///   scripts/derive-operator-allowlist.py, which says which models and how;
/// - an operator on it whose kernel trusts an argument (an index, a shape another argument must
///   match) has that argument checked before it runs (operator_checks.hpp);
/// - never, whatever a user adds: backward kernels (`*_backward*`), sparse operators, `.out`
///   variants (they resize their `out` argument), anything taking `unsafe`, and the storage and file
///   operators (`from_file`, `set_`, `resize_`, `_reshape_alias`, ...);
/// - a user who trusts a program's author more may add an operator: allow_exported_operator().
///
/// An operator refused here is a CheckpointError at load naming the node, the operator and why.

#include <trainloop/error.hpp>
#include <trainloop/interpreter/exported_operators.hpp>

#include <mutex>
#include <set>
#include <string>

namespace trainloop::serialization {

namespace detail {

/// Why `space::name.overload` may never run from a file, whatever is allowed, or "".
inline std::string never_allowed_reason(const std::string& space, const std::string& name, const std::string& overload) {
  static const std::set<std::string> storage_or_files = {
      "from_file",   "set_",          "set",           "resize_",         "resize_as_",   "resize_as_sparse_",
      "sparse_resize_", "sparse_resize_and_clear_", "as_strided_", "record_stream", "set_data", "share_memory_",
      "_reshape_alias", "_copy_from", "_copy_from_and_resize", "_resize_output_", "_set_storage_offset"};
  if (storage_or_files.count(name)) {
    return "reads a file or rebinds a tensor's storage, which no exported model needs and a file from a stranger "
           "must not do";
  }
  if (name.find("_backward") != std::string::npos) {
    return "is a backward kernel, which trusts the indices and shapes its forward made (autograd runs the backward "
           "of what the program computes; the program itself never needs one)";
  }
  if (name.find("sparse") != std::string::npos) return "makes or reads a sparse tensor, whose indices its kernels trust";
  const auto ends_with = [&](const std::string& suffix) {
    return overload.size() >= suffix.size() && overload.compare(overload.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  if (ends_with("out") || ends_with("_out") || overload == "grad_input") {
    return "is an .out variant, which resizes the tensor it is given to write into (a parameter, a buffer)";
  }
  if (space == "aten" && (name == "segment_reduce" || name == "_segment_reduce")) return "takes unsafe=True, which skips its checks";
  return {};
}

/// The operators allowed beyond the derived list (allow_exported_operator), and their lock.
struct AddedOperators {
  std::mutex mutex;              ///< guards `names`
  std::set<std::string> names;   ///< "aten::name.overload"
};
inline AddedOperators& added_operators() {
  static AddedOperators added;
  return added;
}

}  // namespace detail

/// @brief Lets programs loaded from now on run `qualified` ("aten::name.overload", overload
/// "default" for none), beyond the list torch.export's graphs of real models were found to use.
/// Allowing an operator means trusting its kernel with a stranger's arguments: add only what the
/// programs you load need, and only from authors you trust.
/// @throws trainloop::ConfigurationError when `qualified` is not namespace::name.overload, or is
///         never allowed (a backward, sparse, .out or storage operator: operator_policy.hpp).
inline void allow_exported_operator(const std::string& qualified) {
  const auto colons = qualified.find("::");
  const auto dot = qualified.rfind('.');
  TRAINLOOP_CHECK(colons != std::string::npos && dot != std::string::npos && dot > colons + 2 && dot + 1 < qualified.size(),
                  "operator '", qualified, "' is not namespace::name.overload; expected e.g. \"aten::cumsum.default\"");
  const std::string space = qualified.substr(0, colons), name = qualified.substr(colons + 2, dot - colons - 2),
                    overload = qualified.substr(dot + 1);
  const std::string never = detail::never_allowed_reason(space, name, overload);
  TRAINLOOP_CHECK(never.empty(), "operator '", qualified, "' ", never, "; expected an operator whose kernel checks its arguments");
  auto& added = detail::added_operators();
  std::lock_guard<std::mutex> lock(added.mutex);
  added.names.insert(qualified);
}

/// @brief Why `space::name.overload` (overload "default" for none) may not run from a file, or ""
/// when it may.
inline std::string refused_operator_reason(const std::string& space, const std::string& name, const std::string& overload) {
  const std::string never = detail::never_allowed_reason(space, name, overload);
  if (!never.empty()) return never;
  const std::string qualified = space + "::" + name + "." + overload;
  if (exported_operators().count(qualified)) return {};
  {
    auto& added = detail::added_operators();
    std::lock_guard<std::mutex> lock(added.mutex);
    if (added.names.count(qualified)) return {};
  }
  return "is not on the list of operators a program from a file may run (those torch.export emits for timm's, "
         "torchvision's and the zoo's models and transformer blocks: interpreter/exported_operators.hpp); if you "
         "trust the program's author, allow it before loading: "
         "trainloop::serialization::allow_exported_operator(\"" + qualified + "\")";
}

}  // namespace trainloop::serialization
