#pragma once
// The model and data shared by ddp_worker (the program DDP re-executes) and the tests that
// compare its result with one process.

#include <trainloop/trainloop.hpp>

struct MlpImpl : torch::nn::Module {
  /// `hidden` 2048: 4.2 M parameters, over the 16 MiB from which a gathered checkpoint goes behind training.
  /// `norm`: a BatchNorm layer after fc1, whose running statistics are buffers (test_elastic).
  explicit MlpImpl(int64_t hidden = 16, bool norm = false) {
    fc1 = register_module("fc1", torch::nn::Linear(6, hidden));
    if (norm) bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, hidden));
    fc3 = register_module("fc3", torch::nn::Linear(hidden, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor h = fc1(x);
    if (!bn.is_empty()) h = bn(h);
    return fc3(torch::tanh(fc2(torch::tanh(h))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, fc3{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Mlp);

/// The MLP with a batch-norm layer, for sync_batchnorm (test_recipe).
struct BnMlpImpl : torch::nn::Cloneable<BnMlpImpl> {
  BnMlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    bn = register_module("bn", trainloop::nn::SyncBatchNorm(16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  trainloop::nn::SyncBatchNorm bn{nullptr};
};
TORCH_MODULE(BnMlp);

/// Parameters and buffers (running statistics) as one flat float tensor.
inline torch::Tensor flat_state(torch::nn::Module& module) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : module.parameters()) flat.push_back(p.detach().flatten().to(torch::kFloat64));
  for (const auto& b : module.buffers()) flat.push_back(b.detach().flatten().to(torch::kFloat64));
  return torch::cat(flat);
}

/// The same data in every process: a seeded 3-class problem.
inline trainloop::data::TensorDataset make_data(int64_t n, uint64_t seed) {
  auto x = torch::randn({n, 6}, at::detail::createCPUGenerator(seed));
  auto y = x.matmul(torch::randn({6, 3}, at::detail::createCPUGenerator(99))).argmax(1);
  return trainloop::data::TensorDataset(x, y, 3);
}

/// All parameters as one flat tensor.
inline torch::Tensor flat_params(const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : params) flat.push_back(p.detach().flatten());
  return torch::cat(flat);
}

/// Saves the model's parameters after every epoch, on the main process only:
/// `<dir>/params_epoch<E>.pt` (exact uneven batches are checked epoch by epoch).
struct SaveParamsEachEpoch : trainloop::Callback {
  explicit SaveParamsEachEpoch(std::string dir) : dir(std::move(dir)) {}
  bool main_process_only() const override { return true; }
  void on_epoch_end(trainloop::TrainState& state, const trainloop::EpochRecord& record) override {
    std::vector<torch::Tensor> params;
    for (const auto& p : state.model->parameters()) params.push_back(p.detach().clone());
    torch::save(params, dir + "/params_epoch" + std::to_string(record.epoch) + ".pt");
  }
  std::string dir;
};

/// Parameters saved by ddp_worker, flattened.
inline torch::Tensor load_params(const std::string& path) {
  std::vector<torch::Tensor> params;
  torch::load(params, path);
  return flat_params(params);
}

/// ddp_worker's "uneven" scenario: 37 samples (not a multiple of world x 4 for 2 or 3 ranks),
/// shuffled, SGD with momentum, 3 epochs.
inline constexpr int64_t kUnevenSamples = 37;
inline constexpr int64_t kUnevenEpochs = 3;

/// One process with batch world*4 over the "uneven" data (what `world` ranks of batch 4 see
/// together), its parameters after each epoch, flattened.
inline std::vector<torch::Tensor> uneven_reference(int world, int64_t accumulation, const std::string& dir) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto options =
      trainloop::TrainLoopOptions().batch_size(4 * world).shuffle(true).seed(3).grad_accumulation_steps(accumulation);
  trainloop::TrainLoop<Mlp> loop(net, make_data(kUnevenSamples, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options);
  loop.fit(kUnevenEpochs, {std::make_shared<SaveParamsEachEpoch>(dir)});
  std::vector<torch::Tensor> epochs;
  for (int64_t e = 1; e <= kUnevenEpochs; ++e) epochs.push_back(load_params(dir + "/params_epoch" + std::to_string(e) + ".pt"));
  return epochs;
}

/// One process with batch world*4: what `world` ranks of batch 4 see together (ddp_worker's
/// "train" and "accumulate" scenarios: 5 steps of SGD with momentum, data in fixed order).
inline torch::Tensor reference_params(int world, int64_t accumulation, int fits = 1) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto options =
      trainloop::TrainLoopOptions().batch_size(4 * world).shuffle(false).grad_accumulation_steps(accumulation);
  trainloop::TrainLoop<Mlp> loop(net, make_data(4 * world * 5 * accumulation, 1), {}, optimizer,
                                 torch::nn::CrossEntropyLoss(), options);
  for (int i = 0; i < fits; ++i) loop.fit(1);
  return flat_params(net->parameters());
}
