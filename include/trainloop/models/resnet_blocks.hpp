#pragma once
/// @file
/// @brief torchvision's residual blocks, with torchvision's child names: BasicBlock (ResNet-18/34)
/// and Bottleneck (ResNet-50/101, v1.5: the stride is on the 3x3 convolution, not the first 1x1).

#include <trainloop/models/batch_norm_layer.hpp>

#include <torch/torch.h>

#include <cstdint>

namespace trainloop::models {

/// @brief A convolution without bias (the batch norm after it has the shift), padded to keep
/// the resolution at stride 1: torchvision's conv3x3 and conv1x1.
/// @param in input channels
/// @param out output channels
/// @param kernel_size 3 or 1
/// @param stride 2 halves the resolution
inline torch::nn::Conv2d resnet_conv(int64_t in, int64_t out, int64_t kernel_size, int64_t stride = 1) {
  return torch::nn::Conv2d(
      torch::nn::Conv2dOptions(in, out, kernel_size).stride(stride).padding(kernel_size / 2).bias(false));
}

/// @brief torchvision's shortcut of a block that changes the shape: a strided 1x1 convolution and a
/// batch norm, a Sequential so that they are named `downsample.0` and `downsample.1`.
/// @param in input channels
/// @param out output channels
/// @param stride the block's stride
/// @param sync_batchnorm trainloop::nn::SyncBatchNorm instead of torch::nn::BatchNorm2d
inline torch::nn::Sequential resnet_downsample(int64_t in, int64_t out, int64_t stride, bool sync_batchnorm) {
  torch::nn::Sequential downsample(resnet_conv(in, out, 1, stride));
  BatchNorm2dLayer(out, sync_batchnorm).append_to(downsample);
  return downsample;
}

/// @brief Two 3x3 convolutions and a shortcut (ResNet-18/34). Children: conv1, bn1, conv2, bn2
/// and, when the shape changes, downsample.
class BasicBlockImpl : public torch::nn::Cloneable<BasicBlockImpl> {
 public:
  /// @brief Output channels per `planes` (torchvision's `expansion`).
  static constexpr int64_t expansion = 1;

  /// @param inplanes input channels
  /// @param planes output channels
  /// @param stride of the first convolution and of the shortcut (2 halves the resolution)
  /// @param sync_batchnorm trainloop::nn::SyncBatchNorm instead of torch::nn::BatchNorm2d
  BasicBlockImpl(int64_t inplanes, int64_t planes, int64_t stride, bool sync_batchnorm)
      : inplanes_(inplanes), planes_(planes), stride_(stride), sync_(sync_batchnorm) {
    reset();
  }

  /// @brief (Re)creates the layers (Cloneable uses it to copy the block).
  void reset() override {
    conv1 = register_module("conv1", resnet_conv(inplanes_, planes_, 3, stride_));
    bn1 = BatchNorm2dLayer(planes_, sync_).register_on(*this, "bn1");
    conv2 = register_module("conv2", resnet_conv(planes_, planes_, 3));
    bn2 = BatchNorm2dLayer(planes_, sync_).register_on(*this, "bn2");
    downsample = nullptr;
    if (stride_ != 1 || inplanes_ != planes_ * expansion)
      downsample = register_module("downsample", resnet_downsample(inplanes_, planes_ * expansion, stride_, sync_));
  }

  /// @brief relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)).
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1(conv1(x)).relu_();  // in place, as torchvision's ReLU(inplace=True)
    out = bn2(conv2(out));
    out += downsample ? downsample->forward(x) : x;
    return out.relu_();
  }

  torch::nn::Conv2d conv1{nullptr};          ///< 3x3, strided
  BatchNorm2dLayer bn1;                      ///< after conv1
  torch::nn::Conv2d conv2{nullptr};          ///< 3x3
  BatchNorm2dLayer bn2;                      ///< after conv2
  torch::nn::Sequential downsample{nullptr};  ///< the shortcut when the shape changes, else empty

 private:
  int64_t inplanes_, planes_, stride_;
  bool sync_;
};
/// @brief Holder of BasicBlockImpl (TORCH_MODULE).
TORCH_MODULE(BasicBlock);

/// @brief 1x1 (reduce), 3x3 (strided), 1x1 (expand by 4) convolutions and a shortcut
/// (ResNet-50/101). Children: conv1, bn1, conv2, bn2, conv3, bn3 and, when the shape changes,
/// downsample.
class BottleneckImpl : public torch::nn::Cloneable<BottleneckImpl> {
 public:
  /// @brief Output channels per `planes` (torchvision's `expansion`).
  static constexpr int64_t expansion = 4;

  /// @param inplanes input channels
  /// @param planes channels of the inner convolutions; the output has planes * 4
  /// @param stride of the 3x3 convolution and of the shortcut (2 halves the resolution)
  /// @param sync_batchnorm trainloop::nn::SyncBatchNorm instead of torch::nn::BatchNorm2d
  BottleneckImpl(int64_t inplanes, int64_t planes, int64_t stride, bool sync_batchnorm)
      : inplanes_(inplanes), planes_(planes), stride_(stride), sync_(sync_batchnorm) {
    reset();
  }

  /// @brief (Re)creates the layers (Cloneable uses it to copy the block).
  void reset() override {
    const int64_t out = planes_ * expansion;
    conv1 = register_module("conv1", resnet_conv(inplanes_, planes_, 1));
    bn1 = BatchNorm2dLayer(planes_, sync_).register_on(*this, "bn1");
    conv2 = register_module("conv2", resnet_conv(planes_, planes_, 3, stride_));  // v1.5: stride here
    bn2 = BatchNorm2dLayer(planes_, sync_).register_on(*this, "bn2");
    conv3 = register_module("conv3", resnet_conv(planes_, out, 1));
    bn3 = BatchNorm2dLayer(out, sync_).register_on(*this, "bn3");
    downsample = nullptr;
    if (stride_ != 1 || inplanes_ != out)
      downsample = register_module("downsample", resnet_downsample(inplanes_, out, stride_, sync_));
  }

  /// @brief relu(bn3(conv3(...)) + shortcut(x)).
  torch::Tensor forward(const torch::Tensor& x) {
    auto out = bn1(conv1(x)).relu_();
    out = bn2(conv2(out)).relu_();
    out = bn3(conv3(out));
    out += downsample ? downsample->forward(x) : x;
    return out.relu_();
  }

  torch::nn::Conv2d conv1{nullptr};          ///< 1x1, reduces to `planes`
  BatchNorm2dLayer bn1;                      ///< after conv1
  torch::nn::Conv2d conv2{nullptr};          ///< 3x3, strided
  BatchNorm2dLayer bn2;                      ///< after conv2
  torch::nn::Conv2d conv3{nullptr};          ///< 1x1, expands to planes * 4
  BatchNorm2dLayer bn3;                      ///< after conv3
  torch::nn::Sequential downsample{nullptr};  ///< the shortcut when the shape changes, else empty

 private:
  int64_t inplanes_, planes_, stride_;
  bool sync_;
};
/// @brief Holder of BottleneckImpl (TORCH_MODULE).
TORCH_MODULE(Bottleneck);

}  // namespace trainloop::models
