#pragma once
/// @file
/// @brief fastai's XResNet (fastai/vision/models/xresnet.py): xresnet18, xresnet34, xresnet50 —
/// ResNet with the "bag of tricks" changes (three-convolution stem, ResNet-D shortcut, zero-init
/// of each block's last batch norm), with fastai's state_dict names.
///
/// fastai's XResNet is an nn.Sequential, so its names are indices:
///
/// | index | layer                                             | names, e.g.                                        |
/// |-------|---------------------------------------------------|----------------------------------------------------|
/// | 0-2   | stem ConvLayers in->32 (stride 2), 32->32, 32->64 | `0.0.weight`, `0.1.running_var`                    |
/// | 3     | MaxPool2d(3, 2, 1)                                |                                                    |
/// | 4-7   | stages: Sequentials of ResBlocks                  | `4.0.convpath.0.0.weight`, `5.0.idpath.1.0.weight` |
/// | 8-10  | AdaptiveAvgPool2d(1), Flatten, Dropout(p)         |                                                    |
/// | 11    | Linear                                            | `11.weight`, `11.bias`                             |

#include <trainloop/error.hpp>
#include <trainloop/models/image_model_options.hpp>
#include <trainloop/models/xresnet_block.hpp>

#include <torch/torch.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace trainloop::models {

/// @brief The shape of a fastai XResNet.
struct XResNetConfig {
  int64_t expansion = 1;                      ///< 1: two 3x3 convolutions a block; 4: bottleneck
  std::array<int64_t, 4> layers{2, 2, 2, 2};  ///< ResBlocks in each of the four stages
  double dropout = 0.0;                       ///< probability of the Dropout before the Linear (fastai's p)

  /// @brief xresnet18: expansion 1, [2, 2, 2, 2].
  static XResNetConfig xresnet18() { return {1, {2, 2, 2, 2}}; }
  /// @brief xresnet34: expansion 1, [3, 4, 6, 3].
  static XResNetConfig xresnet34() { return {1, {3, 4, 6, 3}}; }
  /// @brief xresnet50: expansion 4, [3, 4, 6, 3].
  static XResNetConfig xresnet50() { return {4, {3, 4, 6, 3}}; }

  /// @brief Throws trainloop::ConfigurationError naming the first field that is out of range.
  void validate() const {
    TRAINLOOP_CHECK(expansion == 1 || expansion == 4, "XResNet expansion is ", expansion, "; expected 1 or 4");
    for (size_t i = 0; i < layers.size(); ++i)
      TRAINLOOP_CHECK(layers[i] > 0, "XResNet stage ", i + 1, " has ", layers[i], " blocks; expected 1 or more");
    TRAINLOOP_CHECK(dropout >= 0.0 && dropout < 1.0, "XResNet dropout is ", dropout, "; expected 0 <= p < 1");
  }
};

/// @brief The layers of a fastai XResNet, registered on a module under fastai's names (indices,
/// see the file comment), and the forward pass through them. XResNetImpl and the zoo's
/// ImageClassifierImpl build their structure with it, so neither adds a prefix to the names.
class XResNetLayout {
 public:
  /// @brief No layers (a module's member before its reset() builds them).
  XResNetLayout() = default;

  /// @brief Registers children `0` .. `11` on `owner`, initialised as fastai's init_cnn does.
  /// @param owner the module the layers become children of (it must have no other children)
  /// @param config expansion, blocks per stage, dropout
  /// @param options classes, input channels, kind of batch norm
  XResNetLayout(torch::nn::Module& owner, const XResNetConfig& config, const ImageModelOptions& options) {
    config.validate();
    options.validate();
    const bool sync = options.sync_batchnorm();
    int64_t index = 0;
    auto next_name = [&index] { return std::to_string(index++); };
    const std::array<int64_t, 4> stem_sizes{options.in_channels(), 32, 32, 64};
    for (size_t i = 0; i < 3; ++i) {
      const ConvLayerOptions conv{.stride = i == 0 ? 2 : 1, .sync_batchnorm = sync};
      stem_.push_back(owner.register_module(next_name(), ConvLayer(stem_sizes[i], stem_sizes[i + 1], conv)));
    }
    maxpool_ = owner.register_module(next_name(),
                                     torch::nn::MaxPool2d(torch::nn::MaxPool2dOptions(3).stride(2).padding(1)));
    // fastai's block_szs: a stage's ResBlock takes ni and nf divided by the expansion.
    const std::array<int64_t, 5> sizes{64 / config.expansion, 64, 128, 256, 512};
    for (size_t stage = 0; stage < config.layers.size(); ++stage) {
      torch::nn::Sequential blocks;
      for (int64_t b = 0; b < config.layers[stage]; ++b) {
        const int64_t stride = (stage > 0 && b == 0) ? 2 : 1;
        const int64_t ni = b == 0 ? sizes[stage] : sizes[stage + 1];
        blocks->push_back(ResBlock(config.expansion, ni, sizes[stage + 1], stride, sync));
      }
      stages_.push_back(owner.register_module(next_name(), blocks));
    }
    avgpool_ = owner.register_module(next_name(), torch::nn::AdaptiveAvgPool2d(1));
    flatten_ = owner.register_module(next_name(), torch::nn::Flatten());
    dropout_ = owner.register_module(next_name(), torch::nn::Dropout(config.dropout));
    fc_ = owner.register_module(next_name(), torch::nn::Linear(512 * config.expansion, options.num_classes()));
    // init_cnn: kaiming_normal_ with its defaults (fan_in, gain sqrt(2)) on every convolution and
    // on the Linear, every bias 0. Batch norms keep their weights (1, or 0 for BatchZero).
    for (const auto& module : owner.modules(/*include_self=*/false)) {
      if (auto* conv = module->as<torch::nn::Conv2d>()) torch::nn::init::kaiming_normal_(conv->weight);
    }
    torch::nn::init::kaiming_normal_(fc_->weight);
    torch::nn::init::zeros_(fc_->bias);
  }

  /// @brief Logits [N, num_classes] of an N x in_channels x H x W batch (any H, W >= 1).
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = x;
    for (auto& layer : stem_) out = layer->forward(out);
    out = maxpool_(out);
    for (auto& stage : stages_) out = stage->forward(out);
    return fc_(dropout_(flatten_(avgpool_(out))));
  }

 private:
  std::vector<ConvLayer> stem_;
  torch::nn::MaxPool2d maxpool_{nullptr};
  std::vector<torch::nn::Sequential> stages_;
  torch::nn::AdaptiveAvgPool2d avgpool_{nullptr};
  torch::nn::Flatten flatten_{nullptr};
  torch::nn::Dropout dropout_{nullptr};
  torch::nn::Linear fc_{nullptr};
};

/// @brief fastai's XResNet as a module whose parameters and buffers have fastai's names;
/// replicable by trainloop's DataParallel (Cloneable).
class XResNetImpl : public torch::nn::Cloneable<XResNetImpl> {
 public:
  /// @param config expansion, blocks per stage and dropout, e.g. XResNetConfig::xresnet50()
  /// @param options classes, input channels, kind of batch norm
  explicit XResNetImpl(XResNetConfig config, ImageModelOptions options = {}) : config(config), options(options) {
    reset();
  }

  /// @brief (Re)creates and initialises the layers (Cloneable uses it to copy the model).
  void reset() override { layout_ = XResNetLayout(*this, config, options); }

  /// @brief Logits [N, num_classes] of an N x in_channels x H x W batch.
  torch::Tensor forward(const torch::Tensor& x) { return layout_.forward(x); }

  XResNetConfig config;       ///< the architecture
  ImageModelOptions options;  ///< classes, input channels, kind of batch norm

 private:
  XResNetLayout layout_;
};
/// @brief Holder of XResNetImpl (TORCH_MODULE).
TORCH_MODULE(XResNet);

/// @brief fastai's xresnet18 (11,708,744 parameters at 1000 classes).
inline XResNet xresnet18(const ImageModelOptions& options = {}) { return XResNet(XResNetConfig::xresnet18(), options); }
/// @brief fastai's xresnet34 (21,816,904 parameters at 1000 classes).
inline XResNet xresnet34(const ImageModelOptions& options = {}) { return XResNet(XResNetConfig::xresnet34(), options); }
/// @brief fastai's xresnet50 (25,576,264 parameters at 1000 classes).
inline XResNet xresnet50(const ImageModelOptions& options = {}) { return XResNet(XResNetConfig::xresnet50(), options); }

}  // namespace trainloop::models
