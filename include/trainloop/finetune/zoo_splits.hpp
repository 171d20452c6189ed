#pragma once
/// @file
/// @brief fastai's splits of the zoo's architectures into parameter groups (its _resnet_split and
/// _xresnet_split), under the zoo's names. Included by <trainloop/models.hpp>.
///
/// | family  | group 0 ("stem")                | group 1 ("body")         | group 2 ("head")  |
/// |---------|---------------------------------|--------------------------|-------------------|
/// | resnet  | conv1, bn1, layer1, layer2      | layer3, layer4           | fc                |
/// | xresnet | 0, 1, 2 (the stem's ConvLayers) | 3 - 7 (maxpool, stages)  | 8 - 11 (fc: 11)   |
///
/// fastai splits the body its cnn_learner cut from these models the same way (the first six
/// children of a torchvision resnet: conv1, bn1, relu, maxpool, layer1, layer2; the first three
/// of an xresnet), and puts the head last.

#include <trainloop/finetune/parameter_groups.hpp>
#include <trainloop/models/zoo.hpp>

#include <string>
#include <variant>
#include <vector>

namespace trainloop::models {

/// @brief fastai's three groups (stem, body, head) for an architecture of the zoo's family.
inline std::vector<GroupPrefixes> fastai_split(const ArchitectureConfig& config) {
  if (std::holds_alternative<ResNetConfig>(config)) {
    return {{"stem", {"conv1", "bn1", "layer1", "layer2"}}, {"body", {"layer3", "layer4"}}, {"head", {"fc"}}};
  }
  return {{"stem", {"0", "1", "2"}}, {"body", {"3", "4", "5", "6", "7"}}, {"head", {"8", "9", "10", "11"}}};
}

/// @brief fastai's three groups for the zoo architecture `name` ("resnet50", "xresnet18", ...).
/// @throws trainloop::ConfigurationError for a name the zoo does not have, listing those it has.
inline std::vector<GroupPrefixes> fastai_split(const std::string& name) {
  return fastai_split(architecture_config(name));
}

/// @brief `model` split into fastai's three groups: ParameterGroups(model, fastai_split(...)).
inline ParameterGroups fastai_groups(const ImageClassifierImpl& model) {
  return ParameterGroups(model, fastai_split(model.architecture));
}
/// @brief `model` split into fastai's three groups.
inline ParameterGroups fastai_groups(const ResNetImpl& model) {
  return ParameterGroups(model, fastai_split(ResNetConfig()));
}
/// @brief `model` split into fastai's three groups.
inline ParameterGroups fastai_groups(const XResNetImpl& model) {
  return ParameterGroups(model, fastai_split(XResNetConfig()));
}

}  // namespace trainloop::models
