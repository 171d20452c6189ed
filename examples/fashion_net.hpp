#pragma once
// The small CNN the examples and benchmarks train on Fashion-MNIST: two conv blocks and two
// linear layers (~420k parameters). Published small CNNs reach 91-93% test accuracy.

#include <torch/torch.h>

struct FashionNetImpl : torch::nn::Module {
  FashionNetImpl()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)))),
        fc1(register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128))),
        dropout(register_module("dropout", torch::nn::Dropout(0.25))),
        fc2(register_module("fc2", torch::nn::Linear(128, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(conv1(x)), 2);  // 32 x 14 x 14
    x = torch::max_pool2d(torch::relu(conv2(x)), 2);  // 64 x 7 x 7
    x = dropout(torch::relu(fc1(x.flatten(1))));
    return fc2(x);
  }

  torch::nn::Conv2d conv1, conv2;
  torch::nn::Linear fc1;
  torch::nn::Dropout dropout;
  torch::nn::Linear fc2;
};
TORCH_MODULE(FashionNet);
