#pragma once
/// @file
/// @brief ParameterGroups: a model split into named groups of parameters by module names (fastai's
/// splitter), from which the optimizer's param groups are built and which freeze_to() freezes.
///
/// @code
/// trainloop::ParameterGroups groups(*net, {{"stem", {"conv1", "bn1", "layer1", "layer2"}},
///                                          {"body", {"layer3", "layer4"}},
///                                          {"head", {"fc"}}});
/// auto optimizer = groups.make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(1e-3).momentum(0.9),
///                                                           trainloop::lr_range(trainloop::LrSlice(1e-5, 1e-3), 3));
/// trainloop::freeze(groups);      // only the head (and every BatchNorm) trains
/// trainloop::freeze_to(groups, 1);  // the stem frozen, body and head train
/// @endcode
///
/// The groups hold the model's own parameter tensors, so freezing through them changes the model,
/// and an optimizer built from make_optimizer() (or optimizer_groups()) steps the same tensors.

#include <trainloop/error.hpp>
#include <trainloop/finetune/freeze.hpp>
#include <trainloop/finetune/parameter_selection.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace trainloop {

/// @brief One named group of a ParameterGroups: the parameters under `prefixes`.
struct GroupPrefixes {
  std::string name;                   ///< for messages, e.g. "head"
  std::vector<std::string> prefixes;  ///< module (or parameter) names, e.g. {"layer3", "layer4"}
};

/// @brief A model's parameters split into ordered, named groups (body first, head last).
class ParameterGroups {
 public:
  /// @brief Splits `module`'s parameters: group g holds every parameter under one of
  /// `groups[g].prefixes`. Every parameter must fall in exactly one group, and every group must
  /// hold at least one parameter (a parameter left out would be neither trained nor frozen).
  /// @throws trainloop::ConfigurationError for an unknown name (listing the names that exist), a
  ///         parameter in no group or in two, or an empty group.
  ParameterGroups(const torch::nn::Module& module, std::vector<GroupPrefixes> groups) : specs_(std::move(groups)) {
    TRAINLOOP_CHECK(!specs_.empty(), "ParameterGroups was given no groups; expected at least one");
    for (const auto& spec : specs_) detail::check_prefixes(module, spec.prefixes);
    members_.resize(specs_.size());
    for (auto& parameter : detail::named_parameters_of(module)) {
      std::vector<std::size_t> owners;
      for (std::size_t g = 0; g < specs_.size(); ++g) {
        for (const auto& prefix : specs_[g].prefixes) {
          if (detail::under_prefix(parameter.name, prefix)) {
            owners.push_back(g);
            break;
          }
        }
      }
      TRAINLOOP_CHECK(!owners.empty(), "parameter \"", parameter.name, "\" is in no group of ParameterGroups (",
                      described(), "); expected every parameter in one group");
      TRAINLOOP_CHECK(owners.size() == 1, "parameter \"", parameter.name, "\" is in groups \"", specs_[owners[0]].name,
                      "\" and \"", specs_[owners[1]].name, "\"; expected every parameter in one group");
      members_[owners[0]].push_back(std::move(parameter));
    }
    for (std::size_t g = 0; g < specs_.size(); ++g) {
      TRAINLOOP_CHECK(!members_[g].empty(), "group \"", specs_[g].name,
                      "\" holds no parameters; expected at least one");
    }
  }

  /// @brief fastai's default split: a "body" group of everything outside `head_prefixes`, then a
  /// "head" group of what is under them.
  /// @throws trainloop::ConfigurationError as the constructor.
  static ParameterGroups body_and_head(const torch::nn::Module& module, const std::vector<std::string>& head_prefixes) {
    detail::check_prefixes(module, head_prefixes);
    std::vector<std::string> body;
    for (const auto& parameter : detail::named_parameters_of(module)) {
      bool in_head = false;
      for (const auto& prefix : head_prefixes) in_head = in_head || detail::under_prefix(parameter.name, prefix);
      if (!in_head) body.push_back(parameter.name);
    }
    return ParameterGroups(module, {{"body", std::move(body)}, {"head", head_prefixes}});
  }

  /// @brief The number of groups.
  std::size_t size() const { return specs_.size(); }
  /// @brief Group `g`'s name.
  const std::string& name(std::size_t g) const { return specs_.at(g).name; }
  /// @brief Group `g`'s parameters, in the model's order.
  std::vector<torch::Tensor> parameters(std::size_t g) const {
    std::vector<torch::Tensor> tensors;
    for (const auto& parameter : members_.at(g)) tensors.push_back(parameter.tensor);
    return tensors;
  }
  /// @brief The full names of group `g`'s parameters, in the model's order.
  std::vector<std::string> parameter_names(std::size_t g) const {
    std::vector<std::string> names;
    for (const auto& parameter : members_.at(g)) names.push_back(parameter.name);
    return names;
  }

  /// @brief The optimizer's param groups, one per group in order, each with a copy of `options`;
  /// with `learning_rates` (one per group, e.g. lr_range()), group g's learning rate is rates[g].
  /// An optimizer built from them by its constructor may change them on libtorch 2.15 and later
  /// (see make_optimizer(), which builds one that keeps them).
  /// @throws trainloop::ConfigurationError when learning_rates is neither empty nor one per group.
  std::vector<torch::optim::OptimizerParamGroup> optimizer_groups(
      const torch::optim::OptimizerOptions& options, const std::vector<double>& learning_rates = {}) const {
    TRAINLOOP_CHECK(learning_rates.empty() || learning_rates.size() == size(), "ParameterGroups has ", size(),
                    " groups but ", learning_rates.size(), " learning rates were given; expected one per group");
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (std::size_t g = 0; g < size(); ++g) {
      auto group_options = options.clone();
      if (!learning_rates.empty()) group_options->set_lr(learning_rates[g]);
      groups.emplace_back(parameters(g), std::move(group_options));
    }
    return groups;
  }

  /// @brief An optimizer of type `OptimizerType` over these groups, in order, each group with a copy
  /// of `options` and, with `learning_rates` (one per group, e.g. lr_range()), group g's learning
  /// rate rates[g]; `options` are also the optimizer's defaults.
  ///
  /// Why not just `OptimizerType(optimizer_groups(options, rates), options)`: from libtorch 2.15 on,
  /// the optimizer's constructor replaces every value of a group that equals the options class's
  /// own default with the defaults' value ("parameter group inheritance"), so a group asking for
  /// Adam's default 1e-3 under defaults of lr 1.0 silently trained at 1.0. This builds the
  /// optimizer, then gives each group back exactly the options it was built with, on every release.
  /// @throws trainloop::ConfigurationError when learning_rates is neither empty nor one per group.
  template <class OptimizerType, class Options>
  OptimizerType make_optimizer(const Options& options, const std::vector<double>& learning_rates = {}) const {
    auto groups = optimizer_groups(options, learning_rates);
    OptimizerType optimizer(groups, options);
    auto& built = optimizer.param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) built.at(g).set_options(groups[g].options().clone());
    return optimizer;
  }

  /// @brief Throws unless `optimizer`'s param groups hold exactly these groups' parameters, in
  /// order (an optimizer built from make_optimizer()).
  void check_matches(const torch::optim::Optimizer& optimizer) const {
    const auto& groups = optimizer.param_groups();
    TRAINLOOP_CHECK(groups.size() == size(), "the optimizer has ", groups.size(),
                    " param groups but ParameterGroups has ", size(), " (", described(),
                    "); expected an optimizer built from ParameterGroups::make_optimizer()");
    for (std::size_t g = 0; g < size(); ++g) {
      const auto& held = groups[g].params();
      bool same = held.size() == members_[g].size();
      for (std::size_t i = 0; same && i < held.size(); ++i) same = held[i].is_same(members_[g][i].tensor);
      TRAINLOOP_CHECK(same, "the optimizer's param group ", g, " holds ", held.size(),
                      " parameters that are not group \"", specs_[g].name, "\"'s ", members_[g].size(),
                      "; expected an optimizer built from ParameterGroups::make_optimizer()");
    }
  }

  /// @brief Freezes groups [0, n) and makes groups [n, size()) trainable (fastai's freeze_to); a
  /// negative n counts from the end (-1: every group but the last frozen). Frozen groups keep
  /// their normalization layers trainable with FreezeOptions::train_bn.
  /// @throws trainloop::ConfigurationError when n is out of [-size(), size()].
  void freeze_to(std::int64_t n, const FreezeOptions& options = FreezeOptions()) const {
    const auto count = static_cast<std::int64_t>(size());
    TRAINLOOP_CHECK(n >= -count && n <= count, "freeze_to(", n, ") on ", count, " groups; expected -", count,
                    " <= n <= ", count);
    const std::int64_t frozen = n < 0 ? count + n : n;
    for (std::int64_t g = 0; g < count; ++g) {
      for (const auto& parameter : members_[static_cast<std::size_t>(g)]) {
        detail::set_trainable(parameter.tensor, g >= frozen || (options.train_bn() && parameter.normalization));
      }
    }
  }

 private:
  /// The groups' names, "stem, body, head".
  std::string described() const {
    std::string text;
    for (std::size_t g = 0; g < size(); ++g) text += (g ? ", " : "") + specs_[g].name;
    return text;
  }

  std::vector<GroupPrefixes> specs_;
  std::vector<std::vector<detail::NamedParameter>> members_;  // per group, in the model's order
};

/// @brief fastai's freeze_to: groups [0, n) frozen (normalization layers excepted with
/// train_bn), the rest trainable; negative n counts from the end. See ParameterGroups::freeze_to.
inline void freeze_to(const ParameterGroups& groups, std::int64_t n, const FreezeOptions& options = FreezeOptions()) {
  groups.freeze_to(n, options);
}

/// @brief fastai's freeze: every group but the last (the head) frozen.
/// @throws trainloop::ConfigurationError for fewer than two groups (nothing would stay trainable
///         but normalization layers).
inline void freeze(const ParameterGroups& groups, const FreezeOptions& options = FreezeOptions()) {
  TRAINLOOP_CHECK(groups.size() >= 2, "freeze() on ", groups.size(),
                  " parameter group; expected at least two (a body to freeze and a head to train)");
  groups.freeze_to(-1, options);
}

/// @brief fastai's unfreeze: every group trainable.
inline void unfreeze(const ParameterGroups& groups) { groups.freeze_to(0); }

}  // namespace trainloop
