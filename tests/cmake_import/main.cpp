// Built against the installed trainloop package by the ctest test `cmake_import`: includes the
// umbrella header, trains a tiny classifier and exits 0 only when its training loss fell.
#include <trainloop/trainloop.hpp>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>

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

/// With TRAINLOOP_EXPECT_LIBRARIES_UNDER set (the test sets it to the pip wheel's
/// site-packages/nvidia when libtorch is a wheel): every NCCL and CUDA runtime library this process
/// loaded must come from there, not from an older copy in the CUDA toolkit or the ld.so cache.
/// Returns the number of libraries found elsewhere (and prints them).
int libraries_outside_the_wheel() {
  const char* expected = std::getenv("TRAINLOOP_EXPECT_LIBRARIES_UNDER");
  if (expected == nullptr || *expected == '\0') return 0;
  std::ifstream maps("/proc/self/maps");
  int outside = 0, inside = 0;
  for (std::string line; std::getline(maps, line);) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string name = path.substr(path.rfind('/') + 1);
    if (name.rfind("libnccl.so", 0) != 0 && name.rfind("libcudart.so", 0) != 0) continue;
    if (path.rfind(expected, 0) == 0) {
      ++inside;
    } else {
      std::cerr << "FAIL: " << path << " was loaded; expected the wheel's copy under " << expected << "\n";
      ++outside;
    }
  }
  if (inside == 0) {
    std::cerr << "FAIL: no libnccl.so / libcudart.so loaded from " << expected << "\n";
    return 1;
  }
  std::cout << "NCCL and the CUDA runtime came from " << expected << " (" << inside << " mappings)\n";
  return outside;
}

int main() {
  if (libraries_outside_the_wheel() != 0) return EXIT_FAILURE;
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
