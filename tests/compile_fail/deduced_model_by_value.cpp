// Must not compile: TrainLoop's template arguments deduced from a module passed by value (not a
// TORCH_MODULE holder, not a shared_ptr). ctest's compile_fail builds it (all_cases.cpp) and expects
// model_of_handle's static_assert text, which says what to pass instead.

#include <trainloop/trainloop.hpp>

namespace compile_fail_deduced_model_by_value {

struct NetImpl : torch::nn::Module {
  NetImpl() { fc = register_module("fc", torch::nn::Linear(4, 2)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};

void run() {
  NetImpl net;
  torch::optim::SGD optimizer(net.parameters(), torch::optim::SGDOptions(0.1));
  trainloop::data::TensorDataset data(torch::zeros({8, 4}), torch::zeros({8}, torch::kLong), 2);
  trainloop::TrainLoop loop(net, data, {}, optimizer, torch::nn::CrossEntropyLoss());  // the module by value
  loop.fit(1);
}

}  // namespace compile_fail_deduced_model_by_value
