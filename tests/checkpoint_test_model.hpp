#pragma once
// The small model, data and "program run" shared by the checkpoint tests (test_checkpoint,
// test_checkpoint_files): a loop built from scratch as a restarted process builds it.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/trainloop.hpp>

#include "unit_test.hpp"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace tl = trainloop;

/// A 3-class problem: the class is the argmax of a fixed projection of 8 inputs.
inline tl::data::TensorDataset blobs(int64_t n, uint64_t seed) {
  auto x = torch::randn({n, 8}, at::detail::createCPUGenerator(seed));
  auto y = x.matmul(torch::randn({8, 3}, at::detail::createCPUGenerator(1234))).argmax(1);
  return tl::data::TensorDataset(x, y, 3);
}

/// With dropout, so that the random stream matters for exactness.
struct NetImpl : torch::nn::Module {
  explicit NetImpl(double dropout) : p(dropout) {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  NetImpl() : NetImpl(0.0) {}  // DataParallel builds its replicas this way: no dropout there
  torch::Tensor forward(torch::Tensor x) {
    return fc2(torch::dropout(torch::relu(fc1(x)), p, is_training()));
  }
  double p;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);


inline torch::Tensor flat(const std::vector<torch::Tensor>& tensors) {
  std::vector<torch::Tensor> parts;
  for (const auto& t : tensors) parts.push_back(t.detach().reshape({-1}).to(torch::kCPU, torch::kFloat64));
  return torch::cat(parts);
}

/// Adam's whole state, flattened in parameter order: step count, first and second moments.
inline torch::Tensor optimizer_state(torch::optim::Adam& optimizer) {
  std::vector<torch::Tensor> parts;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      // The state's key: the parameter's TensorImpl address.
      auto found = optimizer.state().find(trainloop::detail::optimizer_state_key(optimizer.state(), p));
      BOOST_REQUIRE(found != optimizer.state().end());
      auto& state = static_cast<torch::optim::AdamParamState&>(*found->second);
      parts.push_back(torch::full({1}, static_cast<double>(state.step()), torch::kFloat64));
      parts.push_back(state.exp_avg().reshape({-1}).to(torch::kFloat64));
      parts.push_back(state.exp_avg_sq().reshape({-1}).to(torch::kFloat64));
    }
  }
  return torch::cat(parts);
}

/// One "program run": a model, an optimizer and a loop built from scratch, as a restarted
/// process builds them (the weights seeded differently, so a resume has to load them).
struct Run {
  Net net;
  torch::optim::Adam optimizer;
  tl::TrainLoop<Net, tl::gpu_mode::Any> loop;
  Run(uint64_t init_seed, tl::gpu_mode::Any mode, double dropout = 0.2, tl::TrainLoopOptions options = base_options())
      : net((torch::manual_seed(init_seed), Net(dropout))),
        optimizer(net->parameters(), torch::optim::AdamOptions(1e-2)),
        loop(net, blobs(60, 1), blobs(30, 2), optimizer, torch::nn::CrossEntropyLoss(), options, std::move(mode)) {}
  static tl::TrainLoopOptions base_options() {
    return tl::TrainLoopOptions().batch_size(8).seed(3).metrics({std::make_shared<tl::Accuracy>()});
  }
  torch::Tensor params() const { return flat(net->parameters()); }
};

inline void require_same_history(const tl::History& a, const tl::History& b) {
  BOOST_REQUIRE_EQUAL(a.epochs.size(), b.epochs.size());
  for (size_t i = 0; i < a.epochs.size(); ++i) {
    BOOST_TEST(a.epochs[i].epoch == b.epochs[i].epoch);
    BOOST_TEST(a.epochs[i].steps == b.epochs[i].steps);
    BOOST_TEST(a.epochs[i].samples == b.epochs[i].samples);
    BOOST_TEST(a.epochs[i].train_loss == b.epochs[i].train_loss);  // bit for bit
    BOOST_TEST(a.epochs[i].train_metrics.at("accuracy") == b.epochs[i].train_metrics.at("accuracy"));
    BOOST_REQUIRE(a.epochs[i].validation.has_value() == b.epochs[i].validation.has_value());
    if (a.epochs[i].validation) BOOST_TEST(a.epochs[i].validation->loss == b.epochs[i].validation->loss);
  }
  BOOST_TEST(a.total_steps == b.total_steps);
}

