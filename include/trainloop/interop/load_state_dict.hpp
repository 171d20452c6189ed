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
  for (size_t i = 0; i < names.size() && i < shown; ++i) text += (i ? ", " : "") + names[i];
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
    text << separator << report.mismatched.size() << " wrong shape (" << first.name << " is "
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

/// The model's part of a trainloop checkpoint (checkpoint/checkpoint_file.hpp): the parameters
/// and buffers torch::save(model) wrote at the top, by name; trainloop's own entry is skipped.
inline void append_archive(torch::serialize::InputArchive& archive, const std::string& prefix, StateDict& out) {
  for (const auto& key : archive.keys()) {
    if (prefix.empty() && key == trainloop::detail::kCheckpointKey) continue;
    torch::Tensor tensor;
    torch::serialize::InputArchive child;
    if (archive.try_read(key, tensor)) {
      out.emplace_back(prefix + key, tensor.detach());  // parameters come back requiring grad
    } else if (archive.try_read(key, child)) {
      append_archive(child, prefix + key + ".", out);
    }
  }
}

}  // namespace detail

/// @brief Reads a state_dict from a file written by Python's `torch.save(model.state_dict(), path)`
/// (see read_python_state_dict()) or from a trainloop checkpoint (the model's parameters and buffers).
/// @param path the file
/// @return the (name, tensor) pairs, on the CPU
/// @throws trainloop::CheckpointError naming the path when it is neither (a TorchScript archive
///         without trainloop's state, a legacy torch.save file, another file), missing or corrupt.
inline StateDict read_state_dict(const std::filesystem::path& path) {
  auto archive = detail::open_archive(path);
  if (!detail::is_torchscript_archive(*archive)) return detail::read_state_dict_archive(*archive, path);
  archive.reset();
  torch::serialize::InputArchive checkpoint;
  try {
    checkpoint.load_from(path.string(), torch::Device(torch::kCPU));
  } catch (const c10::Error& error) {
    std::throw_with_nested(CheckpointError(detail::concat(
        "trainloop: ", path.string(), " is a TorchScript archive that libtorch cannot load (", detail::first_line(error),
        "); expected a trainloop checkpoint or a file written by Python's torch.save(model.state_dict(), path)")));
  }
  torch::serialize::InputArchive ours;
  if (!checkpoint.try_read(trainloop::detail::kCheckpointKey, ours)) {
    throw CheckpointError(detail::concat(
        "trainloop: ", path.string(), " is a TorchScript archive (torch.jit.save, or torch::save in C++: read that with ",
        "torch::load) without trainloop's '", trainloop::detail::kCheckpointKey, "' entry; expected a trainloop ",
        "checkpoint or a file written by Python's torch.save(model.state_dict(), path)"));
  }
  StateDict state;
  detail::append_archive(checkpoint, "", state);
  return state;
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
