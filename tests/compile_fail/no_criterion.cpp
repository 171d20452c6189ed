// Must not compile: a model with only forward() trained by a TrainLoop built without a criterion.
// ctest's compile_fail builds it (all_cases.cpp) and expects require_own_loss's static_assert text.

#include <trainloop/trainloop.hpp>

namespace compile_fail_no_criterion {

void run() {
  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  trainloop::data::TensorDataset data(torch::zeros({8, 4}), torch::zeros({8}, torch::kLong), 2);
  trainloop::TrainLoop<torch::nn::Linear> loop(model, data, {}, optimizer);  // no criterion
  loop.fit(1);
}

}  // namespace compile_fail_no_criterion
