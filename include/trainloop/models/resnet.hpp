#pragma once
/// @file
/// @brief torchvision's ResNet v1.5 (resnet18, resnet34, resnet50, resnet101), with torchvision's
/// state_dict names (`conv1.weight`, `layer1.0.bn1.running_mean`, `layer2.0.downsample.0.weight`,
/// `fc.bias`, ...) and initialisation.
///
/// @code
/// auto model = trainloop::models::resnet50(trainloop::models::ImageModelOptions().num_classes(10));
/// auto logits = model->forward(torch::randn({8, 3, 224, 224}));   // [8, 10]
/// @endcode

#include <trainloop/error.hpp>
#include <trainloop/models/batch_norm_layer.hpp>
#include <trainloop/models/image_model_options.hpp>
#include <trainloop/models/resnet_blocks.hpp>

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace trainloop::models {

/// @brief The residual block a ResNet stacks.
enum class ResNetBlock {
  basic,       ///< BasicBlock: two 3x3 convolutions (ResNet-18/34)
  bottleneck,  ///< Bottleneck: 1x1, 3x3, 1x1 with 4x expansion (ResNet-50/101)
};

/// @brief The shape of a torchvision ResNet: its block and the blocks of each stage.
struct ResNetConfig {
  ResNetBlock block = ResNetBlock::basic;   ///< the residual block
  std::array<int64_t, 4> layers{2, 2, 2, 2};  ///< blocks in layer1 .. layer4

  /// @brief ResNet-18: BasicBlock, [2, 2, 2, 2].
  static ResNetConfig resnet18() { return {ResNetBlock::basic, {2, 2, 2, 2}}; }
  /// @brief ResNet-34: BasicBlock, [3, 4, 6, 3].
  static ResNetConfig resnet34() { return {ResNetBlock::basic, {3, 4, 6, 3}}; }
  /// @brief ResNet-50: Bottleneck, [3, 4, 6, 3].
  static ResNetConfig resnet50() { return {ResNetBlock::bottleneck, {3, 4, 6, 3}}; }
  /// @brief ResNet-101: Bottleneck, [3, 4, 23, 3].
  static ResNetConfig resnet101() { return {ResNetBlock::bottleneck, {3, 4, 23, 3}}; }

  /// @brief Throws trainloop::ConfigurationError when a stage has no block.
  void validate() const {
    for (size_t i = 0; i < layers.size(); ++i)
      TRAINLOOP_CHECK(layers[i] > 0, "ResNet layer", i + 1, " has ", layers[i], " blocks; expected 1 or more");
  }
};

/// @brief The layers of a torchvision ResNet, registered on a module under torchvision's names,
/// and the forward pass through them. ResNetImpl and the zoo's ImageClassifierImpl build their
/// structure with it, so both have exactly torchvision's names, without a prefix of their own.
class ResNetLayout {
 public:
  /// @brief No layers (a module's member before its reset() builds them).
  ResNetLayout() = default;

  /// @brief Registers conv1, bn1, layer1 .. layer4 and fc on `owner`, initialised as torchvision
  /// does. The parameterless stages (relu, maxpool, avgpool) are functions in forward().
  /// @param owner the module the layers become children of (it must have no other children)
  /// @param config block and blocks per stage
  /// @param options classes, input channels, kind of batch norm
  ResNetLayout(torch::nn::Module& owner, const ResNetConfig& config, const ImageModelOptions& options) {
    config.validate();
    options.validate();
    const bool sync = options.sync_batchnorm();
    const int64_t expansion =
        config.block == ResNetBlock::basic ? BasicBlockImpl::expansion : BottleneckImpl::expansion;
    const auto stem = torch::nn::Conv2dOptions(options.in_channels(), 64, 7).stride(2).padding(3).bias(false);
    conv1_ = owner.register_module("conv1", torch::nn::Conv2d(stem));
    bn1_ = BatchNorm2dLayer(64, sync).register_on(owner, "bn1");
    int64_t inplanes = 64;
    for (size_t stage = 0; stage < config.layers.size(); ++stage) {
      const int64_t planes = int64_t{64} << stage;  // 64, 128, 256, 512
      torch::nn::Sequential layer;
      for (int64_t b = 0; b < config.layers[stage]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;  // each stage after the first halves the size
        if (config.block == ResNetBlock::basic) {
          layer->push_back(BasicBlock(inplanes, planes, stride, sync));
        } else {
          layer->push_back(Bottleneck(inplanes, planes, stride, sync));
        }
        inplanes = planes * expansion;
      }
      layers_.push_back(owner.register_module("layer" + std::to_string(stage + 1), layer));
    }
    // nn.Linear's default initialisation, as torchvision leaves it.
    fc_ = owner.register_module("fc", torch::nn::Linear(512 * expansion, options.num_classes()));
    // torchvision: kaiming_normal_(mode='fan_out', nonlinearity='relu') for every convolution. Its
    // constant_(weight, 1) and constant_(bias, 0) for batch norms are how both kinds start.
    for (const auto& module : owner.modules(/*include_self=*/false)) {
      if (auto* conv = module->as<torch::nn::Conv2d>())
        torch::nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
    }
  }

  /// @brief Logits [N, num_classes] of an N x in_channels x H x W batch (any H, W >= 1).
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1_(conv1_(x)).relu_();
    out = torch::max_pool2d(out, /*kernel_size=*/3, /*stride=*/2, /*padding=*/1);
    for (auto& layer : layers_) out = layer->forward(out);
    out = torch::adaptive_avg_pool2d(out, {1, 1}).flatten(1);
    return fc_(out);
  }

 private:
  torch::nn::Conv2d conv1_{nullptr};
  BatchNorm2dLayer bn1_;
  std::vector<torch::nn::Sequential> layers_;
  torch::nn::Linear fc_{nullptr};
};

/// @brief torchvision's ResNet v1.5 as a module whose parameters and buffers have torchvision's
/// names; replicable by trainloop's DataParallel (Cloneable).
class ResNetImpl : public torch::nn::Cloneable<ResNetImpl> {
 public:
  /// @param config block and blocks per stage, e.g. ResNetConfig::resnet50()
  /// @param options classes, input channels, kind of batch norm
  explicit ResNetImpl(ResNetConfig config, ImageModelOptions options = {})
      : config(config), options(options) {
    reset();
  }

  /// @brief (Re)creates and initialises the layers (Cloneable uses it to copy the model).
  void reset() override { layout_ = ResNetLayout(*this, config, options); }

  /// @brief Logits [N, num_classes] of an N x in_channels x H x W batch.
  torch::Tensor forward(const torch::Tensor& x) { return layout_.forward(x); }

  ResNetConfig config;        ///< the architecture
  ImageModelOptions options;  ///< classes, input channels, kind of batch norm

 private:
  ResNetLayout layout_;
};
/// @brief Holder of ResNetImpl (TORCH_MODULE).
TORCH_MODULE(ResNet);

/// @brief ResNet-18 (11,689,512 parameters at 1000 classes).
inline ResNet resnet18(const ImageModelOptions& options = {}) { return ResNet(ResNetConfig::resnet18(), options); }
/// @brief ResNet-34 (21,797,672 parameters at 1000 classes).
inline ResNet resnet34(const ImageModelOptions& options = {}) { return ResNet(ResNetConfig::resnet34(), options); }
/// @brief ResNet-50 (25,557,032 parameters at 1000 classes).
inline ResNet resnet50(const ImageModelOptions& options = {}) { return ResNet(ResNetConfig::resnet50(), options); }
/// @brief ResNet-101 (44,549,160 parameters at 1000 classes).
inline ResNet resnet101(const ImageModelOptions& options = {}) { return ResNet(ResNetConfig::resnet101(), options); }

}  // namespace trainloop::models
