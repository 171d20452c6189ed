// Must not compile: a dataset whose batches are not the loop's Batch type (Example<> here).
// ctest's compile_fail builds it (all_cases.cpp) and expects any_dataset.hpp's static_assert text.

#include <trainloop/trainloop.hpp>

namespace compile_fail_dataset_of_other_batches {

struct Tokens {  // a dataset yielding something else than torch::data::Example<>
  torch::Tensor ids;
};

struct TokenDataset : torch::data::datasets::Dataset<TokenDataset, Tokens> {
  Tokens get(size_t) override { return {torch::zeros({4}, torch::kLong)}; }
  c10::optional<size_t> size() const override { return 8; }
};

void run() {
  torch::nn::Linear model(4, 2);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  trainloop::TrainLoop<torch::nn::Linear> loop(model, TokenDataset(), {}, optimizer, torch::nn::CrossEntropyLoss());
  loop.fit(1);
}

}  // namespace compile_fail_dataset_of_other_batches
