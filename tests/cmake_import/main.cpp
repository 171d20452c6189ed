// Built against the installed trainloop package by the ctest test `cmake_import`: includes the
// umbrella header, trains a tiny classifier and exits 0 only when its training loss fell.
#include <trainloop/trainloop.hpp>

#include <cstdlib>
#include <iostream>

// The package's interface must carry the c10d definitions (ProcessGroupGloo.hpp is empty
// without them), whichever libtorch the consumer found.
#ifndef USE_C10D_GLOO
#error "trainloop::trainloop did not define USE_C10D_GLOO"
#endif

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() : fc1(register_module("fc1", torch::nn::Linear(4, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 2))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};
TORCH_MODULE(Net);

}  // namespace

int main() {
  torch::manual_seed(0);
  // Two classes split by the sign of the sum of the inputs: learnable by the net above.
  const auto inputs = torch::randn({256, 4});
  const auto targets = (inputs.sum(1) > 0).to(torch::kLong);
  trainloop::data::TensorDataset train(inputs, targets, 2);

  Net net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  trainloop::TrainLoop<Net> loop(net, train, {}, optimizer, torch::nn::CrossEntropyLoss(),
                                 trainloop::TrainLoopOptions().batch_size(16));
  const auto history = loop.fit(3);

  const double first = history.epochs.front().train_loss;
  const double last = history.last().train_loss;
  std::cout << "trainloop " << TRAINLOOP_VERSION_MAJOR << '.' << TRAINLOOP_VERSION_MINOR << '.'
            << TRAINLOOP_VERSION_PATCH << ": train loss " << first << " -> " << last << " over "
            << history.epochs.size() << " epochs\n";
  if (history.epochs.size() != 3 || !(last < first)) {
    std::cerr << "FAIL: expected 3 epochs and a falling training loss\n";
    return EXIT_FAILURE;
  }
  return EXIT_SUCCESS;
}
