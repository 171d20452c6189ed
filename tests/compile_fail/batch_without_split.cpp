// Must not compile: DataParallel over a custom batch type that cannot be cut into shards.
// ctest's compile_fail builds it (all_cases.cpp) and expects batch_split.hpp's static_assert text.

#include <trainloop/trainloop.hpp>

namespace compile_fail_batch_without_split {

struct Pair {  // a custom batch with what the model contract needs, but no split(parts)
  torch::Tensor x, y;
  int64_t batch_size() const { return x.size(0); }
  Pair to(torch::Device device) const { return {x.to(device), y.to(device)}; }
};

struct PairDataset : torch::data::datasets::BatchDataset<PairDataset, Pair> {
  Pair get_batch(c10::ArrayRef<size_t> indices) override {
    const auto n = static_cast<int64_t>(indices.size());
    return {torch::zeros({n, 4}), torch::zeros({n})};
  }
  c10::optional<size_t> size() const override { return 8; }
};

struct PairModelImpl : torch::nn::Cloneable<PairModelImpl> {
  PairModelImpl() { reset(); }
  void reset() override { fc = register_module("fc", torch::nn::Linear(4, 1)); }
  torch::Tensor batch_loss(const Pair& batch) { return (fc(batch.x).squeeze(1) - batch.y).pow(2).mean(); }
  trainloop::Predictions batch_predictions(const Pair& batch) { return {fc(batch.x).squeeze(1), batch.y}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(PairModel);

void run() {
  PairModel model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  trainloop::TrainLoop<PairModel, trainloop::gpu_mode::DataParallel, Pair> loop(model, PairDataset(), {}, optimizer);
  loop.fit(1);
}

}  // namespace compile_fail_batch_without_split
