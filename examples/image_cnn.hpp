#pragma once
// A small CNN for any image size and channel count: the Fashion-MNIST CNN of fashion_net.hpp with
// an adaptive pooling to 7 x 7 before the classifier. On 1 x 28 x 28 images the pooling is the
// identity and the layers are created in the same order, so with the same seed it computes exactly
// what FashionNet computes.

#include <torch/torch.h>

struct ImageCnnImpl : torch::nn::Module {
  ImageCnnImpl(int64_t channels, int64_t classes)
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(channels, 32, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128))),
        dropout(register_module("dropout", torch::nn::Dropout(0.25))),
        fc2(register_module("fc2", torch::nn::Linear(128, classes))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);
    x = torch::adaptive_avg_pool2d(x, {7, 7});
    x = dropout(torch::relu(fc1(x.flatten(1))));
    return fc2(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1;
  torch::nn::Dropout dropout;
  torch::nn::Linear fc2;
};
TORCH_MODULE(ImageCnn);
