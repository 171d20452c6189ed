#pragma once
/// @file
/// @brief Loading a state_dict into a model by name, as Python's `model.load_state_dict()`:
/// strict (everything must fit, else nothing is copied and one error lists every difference) or
/// not (what fits is copied, the differences are reported).
///
/// The source is a StateDict, a file written by Python's `torch.save(model.state_dict(), path)`
/// (interop/python_state_dict.hpp), or a trainloop checkpoint, of which the model's part is read.

#include <trainloop/checkpoint/checkpoint_file.hpp>
#include <trainloop/error.hpp>
#include <trainloop/interop/python_state_dict.hpp>
#include <trainloop/interop/state_dict.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <filesystem>
#include <sstream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace trainloop::interop {

/// @brief How load_state_dict() treats a state_dict that does not fit the model exactly.
struct LoadOptions {
  /// true: any missing, unexpected or wrongly shaped entry is an error and nothing is copied;
  /// false: what fits is copied and the rest is reported in the LoadReport.
  bool strict = true;
};

/// @brief An entry of the state_dict whose shape differs from the model's tensor of that name.
struct ShapeMismatch {
  std::string name;                 ///< the parameter or buffer
  std::vector<int64_t> in_file;     ///< its shape in the state_dict
  std::vector<int64_t> in_model;    ///< its shape in the model
};

/// @brief What load_state_dict() did.
struct LoadReport {
  std::vector<std::string> loaded;       ///< copied into the model
  std::vector<std::string> missing;      ///< in the model, not in the state_dict (left as they were)
  std::vector<std::string> unexpected;   ///< in the state_dict, not in the model (ignored)
  std::vector<ShapeMismatch> mismatched; ///< in both with other shapes (left as they were)
  /// @brief True when every tensor of the model was loaded and every entry was used.
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

namespace detail {

using trainloop::detail::concat;

/// "a, b, c" for at most `shown` names, then "and N more".
inline std::string name_list(const std::vector<std::string>& names, size_t shown = 8) {
  std::string text;
  // Names can come from a stranger's file: each escaped and cut (serialization/quoted.hpp).
  for (size_t i = 0; i < names.size() && i < shown; ++i) text += (i ? ", " : "") + serialization::escape_untrusted(names[i]);
  if (names.size() > shown) text += concat(" and ", names.size() - shown, " more");
  return text;
}

/// The one message of a strict load that does not fit; `source` is "state_dict <path>" or "the state_dict".
inline std::string mismatch_message(const LoadReport& report, const std::string& source, const char* where) {
  std::ostringstream text;
  text << "trainloop: " << source << " does not fit the model: ";
  const char* separator = "";
  if (!report.missing.empty()) {
    text << report.missing.size() << " missing (" << name_list(report.missing) << ")";
    separator = ", ";
  }
  if (!report.unexpected.empty()) {
    text << separator << report.unexpected.size() << " unexpected (" << name_list(report.unexpected) << ")";
    separator = ", ";
  }
  if (!report.mismatched.empty()) {
    const auto& first = report.mismatched.front();
    text << separator << report.mismatched.size() << " wrong shape (" << serialization::escape_untrusted(first.name) << " is "
         << c10::IntArrayRef(first.in_file) << " " << where << "; expected " << c10::IntArrayRef(first.in_model);
    std::vector<std::string> others;
    for (size_t i = 1; i < report.mismatched.size(); ++i) others.push_back(report.mismatched[i].name);
    if (!others.empty()) text << "; also " << name_list(others);
    text << ")";
  }
  text << "; expected a state_dict of this model (nothing was loaded; LoadOptions{.strict = false} loads what fits)";
  return text.str();
}

/// load_state_dict() with the source named for messages.
inline LoadReport load_named(torch::nn::Module& module, const StateDict& state, LoadOptions options,
                             const std::string& source, const char* where) {
  std::unordered_map<std::string, const torch::Tensor*> given;
  for (const auto& [name, tensor] : state) given[name] = &tensor;
  LoadReport report;
  std::vector<std::pair<torch::Tensor, const torch::Tensor*>> copies;  // model tensor <- state_dict tensor
  std::unordered_set<std::string> in_model;
  for (auto& [name, target] : module_state_dict(module)) {
    in_model.insert(name);
    const auto found = given.find(name);
    if (found == given.end()) {
      report.missing.push_back(name);
    } else if (found->second->sizes() != target.sizes()) {
      report.mismatched.push_back({name, found->second->sizes().vec(), target.sizes().vec()});
    } else {
      copies.emplace_back(target, found->second);
      report.loaded.push_back(name);
    }
  }
  for (const auto& [name, tensor] : state) {
    if (!in_model.count(name)) report.unexpected.push_back(name);
  }
  if (options.strict && !report.complete()) throw CheckpointError(mismatch_message(report, source, where));
  // Parameters are leaves that require grad: copying into them must not be recorded. copy_
  // converts the dtype and moves to the model tensor's device.
  torch::NoGradGuard no_grad;
  for (auto& [target, source_tensor] : copies) target.copy_(*source_tensor);
  return report;
}

}  // namespace detail

/// @brief Reads a state_dict from a file written by Python's `torch.save(model.state_dict(), path)`
/// (see read_python_state_dict()), from a trainloop checkpoint (the model's parameters and
/// buffers), or from any TorchScript archive (`torch.jit.save`, `torch::save`: the tensors of its
/// module tree by their dotted names).
///
/// Safe on a file from a stranger: no code in the file runs (a TorchScript archive's tensors are
/// read by trainloop's own unpickler; its code is never compiled), nothing is allocated before
/// its size is checked against the file, and every failure is a CheckpointError.
/// @param path the file
/// @return the (name, tensor) pairs, on the CPU
/// @throws trainloop::CheckpointError naming the path when it is none of these (a legacy
///         torch.save file, another file), missing or corrupt.
inline StateDict read_state_dict(const std::filesystem::path& path) {
  auto archive = detail::open_archive(path);
  if (!archive.is_torchscript()) return detail::read_state_dict_archive(archive);
  const auto document = archive.read_pickle("data.pkl", serialization::PickleFlavor::TorchScript);
  try {
    StateDict state;
    for (auto& [name, tensor] : serialization::module_tensors(document, trainloop::detail::kCheckpointKey)) {
      state.emplace_back(std::move(name), tensor.detach());  // parameters are saved requiring grad
    }
    return state;
  } catch (const serialization::PickleError& error) {
    throw CheckpointError(detail::concat("trainloop: state_dict file ", path.string(), " is a TorchScript archive ",
                                         "whose data.pkl is not a module of tensors (", error.what(), "); ",
                                         detail::kExpectedPythonFile));
  }
}

/// @brief Copies the state_dict's tensors into the model's parameters and buffers of the same
/// names, as Python's `model.load_state_dict(state, strict)`; dtype and device are converted to
/// the model tensor's.
/// @param module the model
/// @param state the (name, tensor) pairs
/// @param options strict (the default) or not
/// @return what was loaded, and what did not fit when not strict
/// @throws trainloop::CheckpointError when strict and anything is missing, unexpected or of
///         another shape: one message lists them all, and the model is unchanged.
inline LoadReport load_state_dict(torch::nn::Module& module, const StateDict& state, LoadOptions options = {}) {
  return detail::load_named(module, state, options, "the state_dict", "in the state_dict");
}

/// @brief Loads a state_dict file into the model: one written by Python's
/// `torch.save(model.state_dict(), path)`, or a trainloop checkpoint (its model part); see
/// read_state_dict() and load_state_dict(torch::nn::Module&, const StateDict&, LoadOptions).
/// @param module the model
/// @param path the file
/// @param options strict (the default) or not
/// @return what was loaded, and what did not fit when not strict
/// @throws trainloop::CheckpointError naming the file when it cannot be read, or when strict and
///         it does not fit (the model is unchanged then).
inline LoadReport load_state_dict(torch::nn::Module& module, const std::filesystem::path& path, LoadOptions options = {}) {
  return detail::load_named(module, read_state_dict(path), options, "state_dict " + path.string(), "in the file");
}

}  // namespace trainloop::interop
