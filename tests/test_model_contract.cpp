#define BOOST_TEST_MODULE test_model_contract
#include "unit_test.hpp"

#include <trainloop/trainloop.hpp>

namespace tl = trainloop;

// A batch that is not an (input, target) pair: two inputs whose difference the model regresses.
struct PairBatch {
  torch::Tensor left, right, target;
  int64_t batch_size() const { return target.size(0); }
  PairBatch to(torch::Device device) const { return {left.to(device), right.to(device), target.to(device)}; }
};

// A dataset of such batches, built with libtorch's BatchDataset so get_batch returns PairBatch.
class PairDataset : public torch::data::datasets::BatchDataset<PairDataset, PairBatch> {
 public:
  explicit PairDataset(int64_t n) {
    auto generator = at::detail::createCPUGenerator(3);
    left_ = torch::randn({n, 4}, generator);
    right_ = torch::randn({n, 4}, generator);
    target_ = (left_ - right_).sum(1, true) * 0.5;
  }
  PairBatch get_batch(c10::ArrayRef<size_t> indices) override {
    std::vector<int64_t> rows(indices.begin(), indices.end());
    auto index = torch::tensor(rows, torch::kLong);
    return {left_.index_select(0, index), right_.index_select(0, index), target_.index_select(0, index)};
  }
  c10::optional<size_t> size() const override { return static_cast<size_t>(left_.size(0)); }

 private:
  torch::Tensor left_, right_, target_;
};

// The custom contract: the model computes its own loss and predictions from a PairBatch.
struct SiameseImpl : torch::nn::Module {
  SiameseImpl() { encoder = register_module("encoder", torch::nn::Linear(4, 1)); }
  torch::Tensor batch_loss(const PairBatch& batch, tl::Criterion& criterion) {
    return criterion(encoder(batch.left) - encoder(batch.right), batch.target);
  }
  tl::Predictions batch_predictions(const PairBatch& batch) {
    return {encoder(batch.left) - encoder(batch.right), batch.target};
  }
  torch::nn::Linear encoder{nullptr};
};
TORCH_MODULE(Siamese);

// The same model with a loss of its own: batch_loss(batch) takes no criterion.
struct OwnLossSiameseImpl : SiameseImpl {
  torch::Tensor batch_loss(const PairBatch& batch) {
    return torch::mse_loss(encoder(batch.left) - encoder(batch.right), batch.target);
  }
};
TORCH_MODULE(OwnLossSiamese);

// Which contract each model has, as the loop sees it at compile time: a model with only forward()
// has no loss of its own, so a loop without a criterion does not compile for it
// (tests/compile_fail/no_criterion.cpp checks the message).
static_assert(tl::detail::HasCustomContract<OwnLossSiameseImpl, PairBatch>);
static_assert(tl::detail::HasLossWithoutCriterion<OwnLossSiameseImpl, PairBatch>);
static_assert(tl::detail::HasCustomContract<SiameseImpl, PairBatch>);
static_assert(!tl::detail::HasLossWithoutCriterion<SiameseImpl, PairBatch>);
static_assert(!tl::detail::HasCustomContract<torch::nn::LinearImpl, torch::data::Example<>>);

/// Mean absolute error as a user-defined metric: (sum of |error|, count).
struct MeanAbsoluteError : tl::Metric {
  std::string name() const override { return "mae"; }
  int64_t num_statistics() const override { return 2; }
  torch::Tensor statistics(const torch::Tensor& output, const torch::Tensor& target) const override {
    auto sum = (output - target).abs().sum().to(torch::kFloat64).reshape({1});
    return torch::cat({sum, torch::full({1}, static_cast<double>(output.size(0)), torch::kFloat64)});
  }
  double compute(const torch::Tensor& totals) const override {
    return totals[0].item<double>() / totals[1].item<double>();
  }
};

BOOST_AUTO_TEST_CASE(a_model_with_its_own_loss_trains_on_custom_batches) {
  torch::manual_seed(0);
  Siamese net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  auto metric = std::make_shared<MeanAbsoluteError>();
  tl::TrainLoop<Siamese, tl::gpu_mode::Single, PairBatch> loop(
      net, PairDataset(256), PairDataset(64), optimizer, torch::nn::MSELoss(),
      tl::TrainLoopOptions().batch_size(16).metrics({metric}));
  auto history = loop.fit(10);
  const auto& first = history.epochs.front();
  const auto& last = history.last();
  BOOST_TEST_MESSAGE("loss " << first.train_loss << " -> " << last.train_loss << ", val mae "
                             << last.validation->metrics.at("mae"));
  BOOST_TEST(last.train_loss < first.train_loss / 100);  // the target is exactly learnable
  BOOST_TEST(last.validation->metrics.at("mae") < 0.02);
  // The learned encoder is w = 0.5 on every input (target = 0.5 * sum(left - right)).
  BOOST_TEST((net->encoder->weight - 0.5).abs().max().item<double>() < 0.02);
  // predict() uses batch_predictions in dataset order.
  auto predicted = loop.predict(PairDataset(64));
  BOOST_TEST(predicted.size(0) == 64);
}

BOOST_AUTO_TEST_CASE(a_model_with_its_own_loss_needs_no_criterion) {
  // Trained without a criterion, batch_loss(batch) computes what MSELoss computed through the
  // criterion above: the same weights, bit for bit.
  auto train = [](auto net, auto make_loop) {
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
    auto loop = make_loop(net, optimizer);
    auto history = loop.fit(3);
    return std::pair{net->encoder->weight.clone(), history};
  };
  const auto options = tl::TrainLoopOptions().batch_size(16).seed(4);
  torch::manual_seed(0);
  auto [with_criterion, history_with] = train(Siamese(), [&](Siamese net, torch::optim::Optimizer& optimizer) {
    return tl::TrainLoop<Siamese, tl::gpu_mode::Single, PairBatch>(net, PairDataset(256), PairDataset(64), optimizer,
                                                                   torch::nn::MSELoss(), options);
  });
  torch::manual_seed(0);
  auto [without, history_without] = train(OwnLossSiamese(), [&](OwnLossSiamese net, torch::optim::Optimizer& optimizer) {
    return tl::TrainLoop<OwnLossSiamese, tl::gpu_mode::Single, PairBatch>(net, PairDataset(256), PairDataset(64),
                                                                          optimizer, options);
  });
  BOOST_TEST(torch::equal(with_criterion, without));
  BOOST_TEST(history_without.last().train_loss == history_with.last().train_loss);
  BOOST_TEST(history_without.last().validation->loss == history_with.last().validation->loss);
  BOOST_TEST(history_without.last().train_loss < history_without.epochs.front().train_loss);
}

BOOST_AUTO_TEST_CASE(a_deduced_loop_takes_the_batch_type_from_its_dataset_with_and_without_a_criterion) {
  // TrainLoop's deduction guides read PairBatch off PairDataset::get_batch: no template arguments.
  const auto options = tl::TrainLoopOptions().batch_size(16).seed(4);
  auto train = [&](auto net, auto make_loop) {
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
    auto loop = make_loop(net, optimizer);
    return std::pair{net->encoder->weight.clone(), loop.fit(3)};
  };
  torch::manual_seed(0);
  auto [named, named_history] = train(OwnLossSiamese(), [&](OwnLossSiamese net, torch::optim::Optimizer& optimizer) {
    return tl::TrainLoop<OwnLossSiamese, tl::gpu_mode::Single, PairBatch>(net, PairDataset(256), PairDataset(64),
                                                                          optimizer, options);
  });
  torch::manual_seed(0);
  auto [deduced, deduced_history] = train(OwnLossSiamese(), [&](OwnLossSiamese net, torch::optim::Optimizer& optimizer) {
    return tl::TrainLoop(net, PairDataset(256), PairDataset(64), optimizer, options);  // no criterion
  });
  torch::manual_seed(0);
  auto [with_criterion, criterion_history] = train(Siamese(), [&](Siamese net, torch::optim::Optimizer& optimizer) {
    return tl::TrainLoop(net, std::make_shared<PairDataset>(256), PairDataset(64), optimizer, torch::nn::MSELoss(), options);
  });
  static_assert(std::is_same_v<decltype(tl::TrainLoop(std::declval<OwnLossSiamese&>(), PairDataset(1), {},
                                                      std::declval<torch::optim::SGD&>(), options)),
                               tl::TrainLoop<OwnLossSiamese, tl::gpu_mode::Single, PairBatch>>);
  static_assert(std::is_same_v<decltype(tl::TrainLoop(std::declval<Siamese&>(), std::make_shared<PairDataset>(1), {},
                                                      std::declval<torch::optim::SGD&>(), torch::nn::MSELoss())),
                               tl::TrainLoop<Siamese, tl::gpu_mode::Single, PairBatch>>);
  BOOST_TEST(torch::equal(deduced, named));
  BOOST_TEST(torch::equal(with_criterion, named));  // batch_loss(batch) computes what MSELoss does
  BOOST_TEST(deduced_history.last().train_loss == named_history.last().train_loss);
  BOOST_TEST(criterion_history.validation_loss() == named_history.validation_loss());
  BOOST_TEST(named_history.last().train_loss < named_history.epochs.front().train_loss);
}

BOOST_AUTO_TEST_CASE(a_batch_loss_that_calls_a_criterion_never_given_is_a_clear_error) {
  // Siamese's batch_loss(batch, criterion) calls the criterion: without one, fit() says so
  // instead of throwing std::bad_function_call.
  torch::manual_seed(0);
  Siamese net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<Siamese, tl::gpu_mode::Single, PairBatch> loop(net, PairDataset(32), {}, optimizer,
                                                               tl::TrainLoopOptions().batch_size(16));
  std::string message;
  try {
    loop.fit(1);
  } catch (const tl::ConfigurationError& error) {
    message = error.what();
  }
  BOOST_TEST(message.find("batch_loss(batch, criterion) called the criterion") != std::string::npos, message);
  BOOST_TEST(message.find("built without one") != std::string::npos, message);
}

BOOST_AUTO_TEST_CASE(metrics_are_exact_on_hand_computed_cases) {
  // Scores for 4 samples over 3 classes; targets 0, 2, 1, 1.
  auto output = torch::tensor({{0.9, 0.05, 0.05}, {0.2, 0.5, 0.3}, {0.1, 0.3, 0.6}, {0.2, 0.7, 0.1}});
  auto target = torch::tensor({0, 2, 1, 1}, torch::kLong);
  tl::Accuracy accuracy;
  tl::TopKAccuracy top2(2);
  // top-1 hits: sample 0 and 3 -> 2 of 4. top-2 hits: 0 (0), 1 (2 is second), 2 (1 is second), 3 -> 4 of 4.
  auto a = accuracy.statistics(output, target);
  BOOST_TEST(a[0].item<double>() == 2.0);
  BOOST_TEST(a[1].item<double>() == 4.0);
  BOOST_TEST(accuracy.compute(a) == 0.5);
  BOOST_TEST(top2.compute(top2.statistics(output, target)) == 1.0);
  BOOST_TEST(top2.name() == "top2_accuracy");
  // Sums add across uneven batches: 2/4 and 1/1 give 3/5, not the mean of 0.5 and 1.0.
  auto b = accuracy.statistics(torch::tensor({{0.0, 1.0}}), torch::tensor({1}, torch::kLong));
  BOOST_TEST(accuracy.compute(a + b) == 0.6);
  BOOST_CHECK_THROW(tl::TopKAccuracy(0), tl::Error);
  BOOST_CHECK_THROW(tl::TopKAccuracy(5).statistics(output, target), tl::Error);  // k > classes

  // The loop's mean loss is the per-sample mean over uneven batches: batches of 3 and 1.
  auto x = torch::tensor({{1.0}, {2.0}, {3.0}, {10.0}});
  auto y = torch::zeros({4, 1});
  auto model = torch::nn::Linear(torch::nn::LinearOptions(1, 1).bias(false));
  {
    torch::NoGradGuard no_grad;
    model->weight.fill_(1.0);
  }
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.0));
  tl::TrainLoop<torch::nn::Linear> loop(model, tl::data::TensorDataset(x, y), {}, optimizer, torch::nn::MSELoss(),
                                        tl::TrainLoopOptions().batch_size(3));
  auto result = loop.evaluate(tl::data::TensorDataset(x, y));
  BOOST_TEST(result.loss == (1.0 + 4.0 + 9.0 + 100.0) / 4.0, boost::test_tools::tolerance(1e-6));  // float32 loss
  BOOST_TEST(result.samples == 4);
}
