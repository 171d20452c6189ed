#pragma once
/// @file
/// @brief Which parameters of a module a module-name prefix selects, and which belong to a
/// normalization layer: the vocabulary freeze() and ParameterGroups are written in.
///
/// A prefix is a dotted module (or parameter) name as `named_parameters()` spells it: `"layer3"`
/// selects `layer3.0.conv1.weight` and everything else below `layer3`, never `layer30.weight`.
/// A prefix that names nothing in the module is an error listing the names that do exist at
/// that level, so a typo does not silently leave a layer frozen or untrained.

#include <trainloop/error.hpp>
#include <trainloop/nn/sync_batch_norm.hpp>

#include <torch/torch.h>

#include <string>
#include <unordered_set>
#include <vector>

namespace trainloop {

/// @brief True for the layers fastai's `train_bn` keeps trainable in a frozen model (its
/// `norm_types`): BatchNorm1d/2d/3d, InstanceNorm1d/2d/3d, LayerNorm, and trainloop's
/// SyncBatchNorm. (GroupNorm is not among them, as in fastai.) A model from Python
/// (interop::ExportedProgram, interop::ScriptModule) has plain modules named by their Python
/// class: those of the same classes count, and timm's subclasses of them (`BatchNormAct2d`,
/// `LayerNorm2d`), which fastai's isinstance test counts too.
inline bool is_normalization_layer(const torch::nn::Module& module) {
  const auto* m = &module;
  static const std::unordered_set<std::string> python_classes = {
      "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LayerNorm",
      "SyncBatchNorm", "BatchNormAct2d", "LayerNorm2d"};
  return dynamic_cast<const torch::nn::BatchNorm1dImpl*>(m) || dynamic_cast<const torch::nn::BatchNorm2dImpl*>(m) ||
         dynamic_cast<const torch::nn::BatchNorm3dImpl*>(m) || dynamic_cast<const torch::nn::InstanceNorm1dImpl*>(m) ||
         dynamic_cast<const torch::nn::InstanceNorm2dImpl*>(m) ||
         dynamic_cast<const torch::nn::InstanceNorm3dImpl*>(m) || dynamic_cast<const torch::nn::LayerNormImpl*>(m) ||
         dynamic_cast<const nn::SyncBatchNormImpl*>(m) || python_classes.count(module.name()) != 0;
}

namespace detail {

/// One parameter of a module with its full name.
struct NamedParameter {
  std::string name;            ///< as named_parameters() spells it, e.g. "layer1.0.bn1.weight"
  torch::Tensor tensor;        ///< the parameter itself (setting its flags changes the module's)
  bool normalization = false;  ///< owned by a normalization layer (is_normalization_layer)
};

/// Whether `name` is `prefix` itself or lies below it (`prefix` + "." + ...).
inline bool under_prefix(const std::string& name, const std::string& prefix) {
  return name.size() >= prefix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         (name.size() == prefix.size() || name[prefix.size()] == '.');
}

/// Every parameter of `module` once (a tied weight under its first name), in named_parameters()
/// order, marked when a normalization layer owns it.
inline std::vector<NamedParameter> named_parameters_of(const torch::nn::Module& module) {
  std::vector<std::string> norm_prefixes;
  for (const auto& child : module.named_modules("", /*include_self=*/false)) {
    if (is_normalization_layer(*child.value())) norm_prefixes.push_back(child.key());
  }
  const bool whole_module_is_norm = is_normalization_layer(module);
  std::vector<NamedParameter> parameters;
  std::unordered_set<const void*> seen;
  for (const auto& parameter : module.named_parameters(/*recurse=*/true)) {
    if (!seen.insert(parameter.value().unsafeGetTensorImpl()).second) continue;
    bool normalization = whole_module_is_norm;
    for (const auto& prefix : norm_prefixes) normalization = normalization || under_prefix(parameter.key(), prefix);
    parameters.push_back({parameter.key(), parameter.value(), normalization});
  }
  return parameters;
}

/// The names one level below `parent` ("" for the top level): child modules, then the
/// parameters registered directly on it.
inline std::vector<std::string> names_below(const torch::nn::Module& module, const std::string& parent) {
  const torch::nn::Module* owner = &module;
  if (!parent.empty()) {
    for (const auto& child : module.named_modules("", /*include_self=*/false)) {
      if (child.key() == parent) owner = child.value().get();
    }
  }
  const std::string lead = parent.empty() ? "" : parent + ".";
  std::vector<std::string> names;
  for (const auto& child : owner->named_children()) names.push_back(lead + child.key());
  for (const auto& parameter : owner->named_parameters(/*recurse=*/false)) names.push_back(lead + parameter.key());
  return names;
}

/// Throws trainloop::ConfigurationError for the first of `prefixes` that names no module and no
/// parameter of `module`, listing the names that exist at the deepest level that does.
inline void check_prefixes(const torch::nn::Module& module, const std::vector<std::string>& prefixes) {
  std::unordered_set<std::string> known;
  for (const auto& child : module.named_modules("", /*include_self=*/false)) known.insert(child.key());
  for (const auto& parameter : module.named_parameters(/*recurse=*/true)) known.insert(parameter.key());
  for (const auto& prefix : prefixes) {
    if (known.count(prefix) != 0) continue;
    std::string parent = prefix;  // the deepest ancestor that exists: list what is below it
    while (!parent.empty() && known.count(parent) == 0) {
      const auto dot = parent.rfind('.');
      parent = dot == std::string::npos ? "" : parent.substr(0, dot);
    }
    std::string expected;
    for (const auto& name : names_below(module, parent)) expected += (expected.empty() ? "" : ", ") + name;
    if (expected.empty()) expected = "(none: the model has no modules or parameters)";
    throw ConfigurationError(concat("trainloop: module name \"", prefix,
                                    "\" is not a module or parameter of the model; expected one of ", expected,
                                    " or a name below one of them"));
  }
}

}  // namespace detail
}  // namespace trainloop
