// A first program: a small network trained on synthetic data in the mode named on the command
// line (single, dp or ddp), with a validation set and accuracy.
#include <trainloop/trainloop.hpp>

#include <iostream>
#include <string>

int main(int argc, char** argv) {
  namespace tl = trainloop;
  // Two classes of 8-d points. Any sized libtorch dataset works: data::FashionMNIST, data::ImageFolder, ...
  torch::manual_seed(0);  // DDP ranks run main() too: each must build the same data and model
  const torch::Tensor x = torch::randn({512, 8});
  const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  tl::data::TensorDataset train(x.narrow(0, 0, 384), y.narrow(0, 0, 384));
  tl::data::TensorDataset valid(x.narrow(0, 384, 128), y.narrow(0, 384, 128));

  torch::nn::Sequential net(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 2));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));

  const std::string mode = argc > 1 ? argv[1] : "single";  // "single", "dp" or "ddp"
  tl::TrainLoop loop(net, train, valid, optimizer, torch::nn::CrossEntropyLoss(),
                     tl::TrainLoopOptions().batch_size(32).metrics({tl::Accuracy()}), tl::gpu_mode::parse(mode));
  const tl::History history = loop.fit(3);  // `net` holds the trained weights afterwards, in every mode

  if (tl::is_main_process()) {
    std::cout << mode << ": validation accuracy " << history.validation("accuracy") << '\n';
  }
  return 0;
}
