#pragma once
/// @file
/// @brief BatchNorm2dLayer: torch::nn::BatchNorm2d or trainloop::nn::SyncBatchNorm, chosen at run
/// time, under the chosen layer's own parameter and buffer names.

#include <trainloop/nn/sync_batch_norm.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace trainloop::models {

/// @brief A 2-d batch norm whose kind is chosen at run time: torch::nn::BatchNorm2d, or
/// trainloop::nn::SyncBatchNorm when `sync` is true.
///
/// Not a module itself, on purpose: a wrapping module would add a level to every name
/// (`bn1.layer.weight`), and torchvision's or fastai's checkpoints would no longer load by name.
/// The chosen layer is registered directly on its owner (register_on) or appended to a Sequential
/// (append_to), so the names are the layer's own: `bn1.weight`, `bn1.running_mean`, ...
class BatchNorm2dLayer {
 public:
  /// @brief No layer yet (a module's member before its reset() builds it).
  BatchNorm2dLayer() = default;
  /// @brief A new layer, with weight 1 and bias 0 as both kinds start.
  /// @param channels features normalised (C of an N x C x H x W input)
  /// @param sync trainloop::nn::SyncBatchNorm when true, torch::nn::BatchNorm2d when false
  BatchNorm2dLayer(int64_t channels, bool sync) {
    if (sync) {
      sync_ = trainloop::nn::SyncBatchNorm(channels);
    } else {
      plain_ = torch::nn::BatchNorm2d(channels);
    }
  }

  /// @brief Registers the layer as the child `name` of `owner`.
  /// @return itself, for `bn1 = BatchNorm2dLayer(64, sync).register_on(*this, "bn1")`
  BatchNorm2dLayer& register_on(torch::nn::Module& owner, const std::string& name) {
    if (sync_) {
      owner.register_module(name, sync_);
    } else {
      owner.register_module(name, plain_);
    }
    return *this;
  }

  /// @brief Appends the layer to `sequential`, where its name is its index.
  void append_to(torch::nn::Sequential& sequential) const {
    if (sync_) {
      sequential->push_back(sync_);
    } else {
      sequential->push_back(plain_);
    }
  }

  /// @brief Normalises an N x C x H x W input.
  torch::Tensor forward(const torch::Tensor& input) { return sync_ ? sync_->forward(input) : plain_->forward(input); }
  /// @brief Same as forward().
  torch::Tensor operator()(const torch::Tensor& input) { return forward(input); }

  /// @brief The scale, for initialisers (fastai starts some at 0).
  torch::Tensor& weight() { return sync_ ? sync_->weight : plain_->weight; }
  /// @brief True when the layer is a trainloop::nn::SyncBatchNorm.
  bool is_sync() const { return !sync_.is_empty(); }

 private:
  torch::nn::BatchNorm2d plain_{nullptr};
  trainloop::nn::SyncBatchNorm sync_{nullptr};
};

}  // namespace trainloop::models
