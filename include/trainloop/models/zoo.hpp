#pragma once
/// @file
/// @brief The model zoo by name: ImageClassifier, one module type for every architecture, so a
/// program (and `TrainLoop<ImageClassifier, ...>`) picks the architecture at run time.
///
/// @code
/// namespace models = trainloop::models;
/// models::ImageClassifier model(arch, models::ImageModelOptions().num_classes(10));  // "resnet50", ...
/// trainloop::TrainLoop<models::ImageClassifier> loop(model, train, valid, optimizer, criterion);
/// @endcode
///
/// The parameter and buffer names are those of the chosen architecture's origin (torchvision's
/// `conv1.weight` for the resnets, fastai's `0.0.weight` for the xresnets), with no prefix of the
/// wrapper: the layers are registered on the ImageClassifier itself.

#include <trainloop/error.hpp>
#include <trainloop/models/image_model_options.hpp>
#include <trainloop/models/resnet.hpp>
#include <trainloop/models/xresnet.hpp>

#include <torch/torch.h>

#include <ostream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace trainloop::models {

/// @brief An architecture's shape: a torchvision ResNet or a fastai XResNet.
using ArchitectureConfig = std::variant<ResNetConfig, XResNetConfig>;

/// @brief A named architecture of the zoo.
struct Architecture {
  std::string name;           ///< e.g. "resnet50"
  ArchitectureConfig config;  ///< its family and shape
};

/// @brief Every architecture of the zoo, in the order available() lists them.
inline const std::vector<Architecture>& architectures() {
  static const std::vector<Architecture> table{
      {"resnet18", ResNetConfig::resnet18()},    {"resnet34", ResNetConfig::resnet34()},
      {"resnet50", ResNetConfig::resnet50()},    {"resnet101", ResNetConfig::resnet101()},
      {"xresnet18", XResNetConfig::xresnet18()}, {"xresnet34", XResNetConfig::xresnet34()},
      {"xresnet50", XResNetConfig::xresnet50()},
  };
  return table;
}

/// @brief The names ImageClassifier accepts: resnet18, resnet34, resnet50, resnet101, xresnet18,
/// xresnet34, xresnet50.
inline std::vector<std::string> available() {
  std::vector<std::string> names;
  for (const auto& architecture : architectures()) names.push_back(architecture.name);
  return names;
}

/// @brief The shape of the architecture `name`.
/// @throws trainloop::ConfigurationError naming `name` and listing the available ones
inline ArchitectureConfig architecture_config(const std::string& name) {
  std::string expected;
  for (const auto& architecture : architectures()) {
    if (architecture.name == name) return architecture.config;
    expected += (expected.empty() ? "" : ", ") + architecture.name;
  }
  throw ConfigurationError(
      ::trainloop::detail::concat("trainloop: architecture is \"", name, "\"; expected one of ", expected));
}

/// @brief Any architecture of the zoo, chosen by name at run time, as one module type.
///
/// The chosen family's layers are children of this module itself (ResNetLayout or
/// XResNetLayout), so its names are exactly torchvision's or fastai's. Replicable by trainloop's
/// DataParallel (Cloneable): reset() rebuilds the same architecture from `architecture` and
/// `options`.
class ImageClassifierImpl : public torch::nn::Cloneable<ImageClassifierImpl> {
 public:
  /// @param architecture one of available(), e.g. "resnet50"
  /// @param options classes, input channels, kind of batch norm
  /// @throws trainloop::ConfigurationError for an unknown architecture or options out of range
  explicit ImageClassifierImpl(std::string architecture, ImageModelOptions options = {})
      : architecture(std::move(architecture)), options(options) {
    reset();
  }

  /// @brief (Re)creates and initialises the layers (Cloneable uses it to copy the model).
  void reset() override {
    const auto config = architecture_config(architecture);
    if (const auto* resnet = std::get_if<ResNetConfig>(&config)) {
      layout_ = ResNetLayout(*this, *resnet, options);
    } else {
      layout_ = XResNetLayout(*this, std::get<XResNetConfig>(config), options);
    }
  }

  /// @brief Logits [N, num_classes] of an N x in_channels x H x W batch.
  torch::Tensor forward(const torch::Tensor& x) {
    return std::visit([&x](auto& layout) { return layout.forward(x); }, layout_);
  }

  /// @brief Prints `trainloop::models::ImageClassifier(resnet50)`; the layers print as children.
  void pretty_print(std::ostream& stream) const override {
    stream << "trainloop::models::ImageClassifier(" << architecture << ")";
  }

  std::string architecture;   ///< the name it was built from
  ImageModelOptions options;  ///< classes, input channels, kind of batch norm

 private:
  std::variant<ResNetLayout, XResNetLayout> layout_;
};
/// @brief Holder of ImageClassifierImpl (TORCH_MODULE).
TORCH_MODULE(ImageClassifier);

}  // namespace trainloop::models
