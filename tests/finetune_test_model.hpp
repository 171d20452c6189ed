#pragma once
// The model, data and training runs shared by test_finetune (single process, DataParallel) and
// finetune_worker (the program DDP re-executes): every mode runs the very same scenario code.

#include "ddp_test_model.hpp"

#include <trainloop/models.hpp>
#include <trainloop/trainloop.hpp>

#include <string>
#include <vector>

/// A body of two blocks (Linear + LayerNorm, Linear + SyncBatchNorm) and a Linear head. The
/// normalization layers stay trainable when the body is frozen (train_bn). Without batch norm
/// (DataParallel normalises each replica's shard on its own) the second block is Linear alone.
struct FineNetImpl : torch::nn::Cloneable<FineNetImpl> {
  explicit FineNetImpl(bool batch_norm = true) : batch_norm(batch_norm) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    fc2 = register_module("fc2", torch::nn::Linear(16, 16));
    if (batch_norm) bn2 = register_module("bn2", trainloop::nn::SyncBatchNorm(16));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::tanh(norm1(fc1(x)));
    x = fc2(x);
    if (batch_norm) x = bn2(x);
    return head(torch::tanh(x));
  }
  bool batch_norm;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::LayerNorm norm1{nullptr};
  trainloop::nn::SyncBatchNorm bn2{nullptr};
};
TORCH_MODULE(FineNet);

/// The groups: the two body blocks, then the head.
inline std::vector<trainloop::GroupPrefixes> fine_net_split(bool batch_norm) {
  return {{"first", {"fc1", "norm1"}},
          {"second", batch_norm ? std::vector<std::string>{"fc2", "bn2"} : std::vector<std::string>{"fc2"}},
          {"head", {"head"}}};
}

/// Unfreezes every group at the start of epoch `epoch` (inside a fit: the DDP reducer and the
/// DataParallel replicas must follow).
struct UnfreezeAtEpoch : trainloop::Callback {
  const trainloop::ParameterGroups* groups;
  int64_t epoch;
  UnfreezeAtEpoch(const trainloop::ParameterGroups& g, int64_t e) : groups(&g), epoch(e) {}
  void on_epoch_begin(trainloop::TrainState& state) override {
    if (state.epoch == epoch) trainloop::unfreeze(*groups);
  }
};

/// Per step, the learning rate of every param group and the momentum; per fit, the parameters
/// at its end (to see what the frozen phase changed).
struct FineTuneRecorder : trainloop::Callback {
  std::vector<std::vector<double>> learning_rates;  // [step][group]
  std::vector<double> momenta;
  std::vector<torch::Tensor> parameters_after_fit;  // [fit], the model's parameters, flat
  void on_step_end(trainloop::TrainState& state) override {
    std::vector<double> rates;
    for (const auto& group : state.optimizer->param_groups()) rates.push_back(group.options().get_lr());
    learning_rates.push_back(rates);
    momenta.push_back(trainloop::momentum_of(*state.optimizer).value_or(0.0));
  }
  void on_fit_end(trainloop::TrainState& state, const trainloop::History&) override {
    std::vector<torch::Tensor> flat;
    for (const auto& p : state.optimizer->param_groups()) {
      for (const auto& t : p.params()) flat.push_back(t.detach().flatten().clone());
    }
    parameters_after_fit.push_back(torch::cat(flat));
  }
};

/// What a scenario leaves: the model's parameters and buffers (flat, float64).
struct FineTuneRun {
  torch::Tensor initial;  // parameters and buffers before training
  torch::Tensor state;    // after
  std::shared_ptr<FineTuneRecorder> recorder = std::make_shared<FineTuneRecorder>();
};

constexpr int64_t kFineTuneSamples = 48;  // 6 steps of 8 samples an epoch

/// Runs `scenario` in `mode` with batches of `batch_size` (per rank under DDP):
///  - frozen:    freeze(groups) (body frozen, norms and head train), fit 2 epochs
///  - refreeze:  freeze, fit 1; unfreeze, fit 1; freeze_to(1), fit 1 (SGD momentum carries on)
///  - midfit:    freeze, fit 3 epochs with every group unfrozen at the start of epoch 2
///  - fine_tune: fine_tune(loop, optimizer, groups, 2 epochs, base_lr 0.1), freeze_epochs 1
///  - fine_tune_loop_optimizer: the same with the loop's optimizer, fine_tune(loop, groups, ...)
/// SGD with momentum and weight decay: a frozen parameter given any gradient (even zero) moves.
template <class Mode>
FineTuneRun run_finetune_scenario(const std::string& scenario, Mode mode, int64_t batch_size, bool batch_norm) {
  namespace tl = trainloop;
  torch::manual_seed(5);
  FineNet net(batch_norm);
  tl::ParameterGroups groups(*net, fine_net_split(batch_norm));
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);
  auto optimizer = groups.make_optimizer<torch::optim::SGD>(sgd, tl::lr_range(tl::LrSlice(0.005, 0.05), groups.size()));
  auto options = tl::TrainLoopOptions().batch_size(batch_size).shuffle(false).sync_batchnorm(true).num_threads(1);
  tl::TrainLoop<FineNet, Mode> loop(net, make_data(kFineTuneSamples, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                    options, mode);
  FineTuneRun run;
  run.initial = flat_state(*net);
  if (scenario == "frozen") {
    tl::freeze(groups);
    loop.fit(2, {run.recorder});
  } else if (scenario == "refreeze") {
    tl::freeze(groups);
    loop.fit(1, {run.recorder});
    tl::unfreeze(groups);
    loop.fit(1, {run.recorder});
    tl::freeze_to(groups, 1);
    loop.fit(1, {run.recorder});
  } else if (scenario == "midfit") {
    tl::freeze(groups);
    loop.fit(3, {run.recorder, std::make_shared<UnfreezeAtEpoch>(groups, 2)});
  } else if (scenario == "fine_tune") {
    tl::fine_tune(loop, optimizer, groups, 2, 0.1, tl::FineTuneOptions().freeze_epochs(1), {run.recorder});
  } else if (scenario == "fine_tune_loop_optimizer") {
    tl::fine_tune(loop, groups, 2, 0.1, tl::FineTuneOptions().freeze_epochs(1), {run.recorder});
  } else {
    throw std::runtime_error("unknown scenario " + scenario);
  }
  run.state = flat_state(*net);
  return run;
}

/// The zoo's resnet18 (SyncBatchNorm, channels-last by the automatic memory format) fine-tuned as
/// fastai does (fine_tune: one frozen epoch, then every group with discriminative rates), on 16
/// random 3x32x32 images of 4 classes, in `dtype`, with batches of `batch_size` (per rank under
/// DDP). The outside test of issue 38 compared this model's float32 DDP run with one process.
template <class Mode>
torch::Tensor run_zoo_resnet18_fine_tune(Mode mode, int64_t batch_size, torch::ScalarType dtype, uint64_t data_seed) {
  namespace tl = trainloop;
  torch::manual_seed(5);
  tl::models::ImageClassifier net("resnet18", tl::models::ImageModelOptions().num_classes(4).sync_batchnorm(true));
  net->to(dtype);
  tl::ParameterGroups groups(*net, tl::models::fastai_split("resnet18"));
  const auto x = torch::randn({16, 3, 32, 32}, at::detail::createCPUGenerator(data_seed)).to(dtype);
  const auto y = torch::randint(4, {16}, at::detail::createCPUGenerator(data_seed + 1));
  const auto sgd = torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(1e-2);
  auto optimizer = groups.make_optimizer<torch::optim::SGD>(sgd);
  auto options = tl::TrainLoopOptions().batch_size(batch_size).shuffle(false).sync_batchnorm(true).num_threads(1).progress(false);
  tl::TrainLoop<tl::models::ImageClassifier, Mode> loop(net, tl::data::TensorDataset(x, y, 4), {}, optimizer,
                                                        torch::nn::CrossEntropyLoss(), options, mode);
  tl::fine_tune(loop, optimizer, groups, /*epochs=*/1, /*base_lr=*/1e-2, tl::FineTuneOptions().freeze_epochs(1));
  return flat_state(*net);
}
