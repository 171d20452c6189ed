#pragma once
// A stack of `layers` width x width linear layers with ReLU and a `classes`-way head: big
// gradients for little compute (ddp_overlap: communication-heavy steps; zero_memory: a
// ~100 M-parameter model at width 4096, 6 layers).

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

struct DeepLinearImpl : torch::nn::Module {
  DeepLinearImpl(int64_t layers, int64_t width, int64_t classes) {
    for (int64_t i = 0; i < layers; ++i) {
      hidden.push_back(register_module("fc" + std::to_string(i), torch::nn::Linear(width, width)));
    }
    head = register_module("head", torch::nn::Linear(width, classes));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& layer : hidden) x = torch::relu(layer(x));
    return head(x);
  }
  std::vector<torch::nn::Linear> hidden;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(DeepLinear);
