// Must not compile: a model whose forward takes two tensors fits neither training contract.
// ctest's compile_fail builds it (all_cases.cpp) and expects require_model_contract's text.

#include <trainloop/trainloop.hpp>

namespace compile_fail_model_without_contract {

struct TwoInputsImpl : torch::nn::Module {
  torch::Tensor forward(torch::Tensor x, torch::Tensor y) { return x + y; }
};
TORCH_MODULE(TwoInputs);

void run() {
  TwoInputs model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  trainloop::data::TensorDataset data(torch::zeros({8, 4}), torch::zeros({8}, torch::kLong), 2);
  trainloop::TrainLoop<TwoInputs> loop(model, data, {}, optimizer, torch::nn::CrossEntropyLoss());
  loop.fit(1);
}

}  // namespace compile_fail_model_without_contract
