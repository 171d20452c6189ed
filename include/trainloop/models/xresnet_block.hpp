#pragma once
/// @file
/// @brief fastai's ConvLayer and ResBlock (fastai/layers.py), with fastai's child names:
/// `convpath.<i>.<0 conv | 1 bn>` and `idpath.<i>.<0 conv | 1 bn>`.

#include <trainloop/models/batch_norm_layer.hpp>

#include <torch/torch.h>

#include <cstdint>

namespace trainloop::models {

/// @brief How a ConvLayer is built (the subset of fastai's ConvLayer arguments xresnet uses).
struct ConvLayerOptions {
  int64_t kernel_size = 3;      ///< square kernel, padded by (kernel_size - 1) / 2
  int64_t stride = 1;           ///< 2 halves the resolution
  bool zero_bn = false;         ///< batch norm weight starts at 0 (fastai's NormType.BatchZero)
  bool relu = true;             ///< ends with a ReLU (fastai's act_cls; None for false)
  bool sync_batchnorm = false;  ///< trainloop::nn::SyncBatchNorm instead of torch::nn::BatchNorm2d
};

/// @brief fastai's ConvLayer: convolution (no bias: the batch norm has the shift), batch norm and,
/// when `options.relu`, ReLU, as children `0`, `1`, `2` (fastai's ConvLayer is an nn.Sequential).
///
/// A module of its own rather than a torch::nn::Sequential: libtorch cannot nest a Sequential in
/// a Sequential (its forward is a template), and convpath is a Sequential of ConvLayers. The
/// convolution's weights are set by XResNetLayout afterwards, as fastai's init_cnn does.
class ConvLayerImpl : public torch::nn::Cloneable<ConvLayerImpl> {
 public:
  /// @param in input channels
  /// @param out output channels
  /// @param options kernel, stride, batch norm start and kind, activation
  ConvLayerImpl(int64_t in, int64_t out, ConvLayerOptions options) : in_(in), out_(out), options_(options) { reset(); }

  /// @brief (Re)creates the layers (Cloneable uses it to copy the layer).
  void reset() override {
    conv = register_module("0", torch::nn::Conv2d(torch::nn::Conv2dOptions(in_, out_, options_.kernel_size)
                                                      .stride(options_.stride)
                                                      .padding((options_.kernel_size - 1) / 2)
                                                      .bias(false)));
    norm = BatchNorm2dLayer(out_, options_.sync_batchnorm).register_on(*this, "1");
    // fastai starts the weight at 1 (0 for BatchZero) and the bias at 1e-3; init_cnn then sets
    // every bias to 0, which is where torch's batch norm starts anyway.
    if (options_.zero_bn) torch::nn::init::zeros_(norm.weight());
    relu = options_.relu ? register_module("2", torch::nn::ReLU()) : nullptr;
  }

  /// @brief relu(norm(conv(x))), without the relu when built without one.
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = norm(conv(x));
    return relu ? relu(out) : out;
  }

  torch::nn::Conv2d conv{nullptr};  ///< child `0`
  BatchNorm2dLayer norm;            ///< child `1`
  torch::nn::ReLU relu{nullptr};    ///< child `2`, or none

 private:
  int64_t in_, out_;
  ConvLayerOptions options_;
};
/// @brief Holder of ConvLayerImpl (TORCH_MODULE).
TORCH_MODULE(ConvLayer);

/// @brief fastai's ResBlock: a path of ConvLayers (the last one's batch norm zero-initialised,
/// so the block starts as its shortcut) plus the shortcut `idpath`, then ReLU.
///
/// The shortcut is empty (identity), or AvgPool2d(2, ceil_mode) when the stride is 2 followed by
/// a 1x1 ConvLayer without activation when the channels change: ResNet-D's downsampling, which
/// averages instead of dropping three quarters of the positions as a strided 1x1 does.
class ResBlockImpl : public torch::nn::Cloneable<ResBlockImpl> {
 public:
  /// @param expansion 1 (two 3x3 convolutions) or 4 (bottleneck 1x1, 3x3, 1x1)
  /// @param ni input channels / expansion (fastai's convention)
  /// @param nf output channels / expansion; also the inner channels
  /// @param stride of the 3x3 convolution and of the shortcut's pool (1 or 2)
  /// @param sync_batchnorm trainloop::nn::SyncBatchNorm instead of torch::nn::BatchNorm2d
  ResBlockImpl(int64_t expansion, int64_t ni, int64_t nf, int64_t stride, bool sync_batchnorm)
      : expansion_(expansion), ni_(ni), nf_(nf), stride_(stride), sync_(sync_batchnorm) {
    reset();
  }

  /// @brief (Re)creates the layers (Cloneable uses it to copy the block).
  void reset() override {
    const int64_t in = ni_ * expansion_, out = nf_ * expansion_;
    // The first layers end with ReLU; the last one does not, and its batch norm starts at 0.
    const ConvLayerOptions strided{.stride = stride_, .sync_batchnorm = sync_};
    const ConvLayerOptions reduce{.kernel_size = 1, .sync_batchnorm = sync_};
    const ConvLayerOptions last{.kernel_size = expansion_ == 1 ? 3 : 1, .zero_bn = true, .relu = false,
                                .sync_batchnorm = sync_};
    convpath = torch::nn::Sequential();
    if (expansion_ == 1) {
      convpath->push_back(ConvLayer(in, nf_, strided));
    } else {
      convpath->push_back(ConvLayer(in, nf_, reduce));
      convpath->push_back(ConvLayer(nf_, nf_, strided));
    }
    convpath->push_back(ConvLayer(nf_, out, last));
    register_module("convpath", convpath);
    idpath = torch::nn::Sequential();  // fastai puts the pool first (pool_first=True)
    if (stride_ != 1) idpath->push_back(torch::nn::AvgPool2d(torch::nn::AvgPool2dOptions(stride_).ceil_mode(true)));
    if (in != out) {
      idpath->push_back(ConvLayer(in, out, ConvLayerOptions{.kernel_size = 1, .relu = false, .sync_batchnorm = sync_}));
    }
    register_module("idpath", idpath);
    act = register_module("act", torch::nn::ReLU(torch::nn::ReLUOptions(/*inplace=*/true)));
  }

  /// @brief relu(convpath(x) + idpath(x)).
  torch::Tensor forward(const torch::Tensor& x) {
    // An empty Sequential refuses forward(); fastai's empty nn.Sequential is the identity.
    return act(convpath->forward(x) + (idpath->is_empty() ? x : idpath->forward(x)));
  }

  torch::nn::Sequential convpath{nullptr};  ///< the ConvLayers
  torch::nn::Sequential idpath{nullptr};    ///< the shortcut; empty for the identity
  torch::nn::ReLU act{nullptr};             ///< after the sum

 private:
  int64_t expansion_, ni_, nf_, stride_;
  bool sync_;
};
/// @brief Holder of ResBlockImpl (TORCH_MODULE).
TORCH_MODULE(ResBlock);

}  // namespace trainloop::models
