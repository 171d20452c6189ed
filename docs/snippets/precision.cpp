// bf16 autocast and channels-last on the CPU: the forward runs in bfloat16 (weights, gradients
// and the optimizer stay float32); 4-d weights and inputs are stored NHWC.
#include <trainloop/trainloop.hpp>

#include <iostream>

int main() {
  namespace tl = trainloop;
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({256, 1, 12, 12});
  const torch::Tensor y = (x.mean({1, 2, 3}) > 0).to(torch::kLong);
  torch::nn::Sequential net(torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)), torch::nn::ReLU(),
                            torch::nn::MaxPool2d(2), torch::nn::Flatten(), torch::nn::Linear(16 * 6 * 6, 2));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  tl::TrainLoop loop(
      net, tl::data::TensorDataset(x, y), {}, optimizer, torch::nn::CrossEntropyLoss(),
      tl::TrainLoopOptions()
          .batch_size(64)
          .precision(tl::Precision::bf16)                // or tl::parse_precision("bf16"); fp16 needs CUDA
          .memory_format(tl::MemoryFormat::automatic));  // the default: channels-last, as the model has a Conv2d
  const tl::History history = loop.fit(2);  // warns once if this CPU has no native bf16
  std::cout << "training loss " << history.train_loss() << ", " << history.last().samples_per_second
            << " samples/s; the conv weight is channels-last: " << std::boolalpha
            << net->parameters()[0].is_contiguous(torch::MemoryFormat::ChannelsLast) << '\n';
  return 0;
}
