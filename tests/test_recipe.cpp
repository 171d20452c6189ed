#define BOOST_TEST_MODULE test_recipe
#include "unit_test.hpp"

// The training recipe: schedules, early stopping, reduce-on-plateau, mixed precision, the loss
// scaler, the learning-rate finder and MixUp, in one process (single and DataParallel). Their
// DDP share (2 and 3 ranks) is at the end, through ddp_worker.

#include "ddp_test_model.hpp"
#include "test_paths.hpp"
#include "test_support.hpp"

#include <trainloop/trainloop.hpp>

#include <unistd.h>

#include <array>
#include <barrier>
#include <thread>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <numbers>
#include <string>
#include <vector>

namespace tl = trainloop;
namespace fs = std::filesystem;

namespace {

/// fastai's one-cycle, written from its definition (combine_scheds of two SchedCos at position
/// k/N): not from the code under test.
double fastai_cos(double start, double end, double pos) { return start + (1 + std::cos(std::numbers::pi * (1 - pos))) * (end - start) / 2; }
double fastai_one_cycle_lr(int64_t k, int64_t n, double max_lr) {
  const double pos = static_cast<double>(k) / static_cast<double>(n), pct = 0.25;
  return pos < pct ? fastai_cos(max_lr / 25, max_lr, pos / pct) : fastai_cos(max_lr, max_lr / 1e5, (pos - pct) / (1 - pct));
}
double fastai_one_cycle_momentum(int64_t k, int64_t n) {
  const double pos = static_cast<double>(k) / static_cast<double>(n), pct = 0.25;
  return pos < pct ? fastai_cos(0.95, 0.85, pos / pct) : fastai_cos(0.85, 0.95, (pos - pct) / (1 - pct));
}

/// Calls a schedule's hooks as the loop does for step `k` of `n`, on `optimizer`.
tl::ScheduledValues scheduled(tl::StepSchedule& schedule, torch::optim::Optimizer& optimizer, int64_t k, int64_t n) {
  tl::TrainState state;
  state.optimizer = &optimizer;
  state.planned_steps = n;
  state.step = 0;
  state.epoch = state.first_epoch = 1;
  schedule.on_fit_begin(state);
  state.step = k;
  schedule.on_before_optimizer_step(state);
  return {tl::learning_rate_of(optimizer), tl::momentum_of(optimizer)};
}

struct Problem {
  Mlp net;
  torch::optim::SGD optimizer;
  Problem(double lr = 0.05) : net((torch::manual_seed(5), Mlp())), optimizer(net->parameters(), torch::optim::SGDOptions(lr).momentum(0.9)) {}
};

tl::TrainLoopOptions small_options() {
  return tl::TrainLoopOptions().batch_size(8).metrics({std::make_shared<tl::Accuracy>()});
}

template <class Mode = tl::gpu_mode::Single>
tl::TrainLoop<Mlp, Mode> make_loop(Problem& p, tl::TrainLoopOptions options = small_options(), Mode mode = Mode()) {
  return tl::TrainLoop<Mlp, Mode>(p.net, make_data(160, 1), make_data(64, 2), p.optimizer, torch::nn::CrossEntropyLoss(),
                                  options, mode);
}


}  // namespace

// ---- Schedules: values against the published formulas ------------------------------------------

BOOST_AUTO_TEST_CASE(one_cycle_follows_fastai_formula_for_lr_and_momentum) {
  Problem p;
  tl::OneCycle schedule(tl::OneCycleOptions(0.1));
  const int64_t n = 40;
  for (int64_t k : {0, 1, 5, 9, 10, 11, 20, 30, 39}) {
    auto v = scheduled(schedule, p.optimizer, k, n);
    BOOST_TEST(v.learning_rate == fastai_one_cycle_lr(k, n, 0.1), boost::test_tools::tolerance(1e-12));
    BOOST_TEST(*v.momentum == fastai_one_cycle_momentum(k, n), boost::test_tools::tolerance(1e-12));
  }
  // Known points: the start is max/div, the peak at pct_start, the momentum lowest there.
  BOOST_TEST(scheduled(schedule, p.optimizer, 0, n).learning_rate == 0.004, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(scheduled(schedule, p.optimizer, 10, n).learning_rate == 0.1, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(*scheduled(schedule, p.optimizer, 10, n).momentum == 0.85, boost::test_tools::tolerance(1e-12));
}

BOOST_AUTO_TEST_CASE(one_cycle_with_pytorch_positions_equals_pytorch_one_cycle_lr) {
  // Values printed by Python torch 1.13.1 (Debian python3-torch):
  //   OneCycleLR(SGD(lr=0.1, momentum=0.9), max_lr=0.1, total_steps=100), lr and momentum per step.
  const std::map<int64_t, std::array<double, 2>> sgd{
      {0, {0.0040000000000000036, 0.95}},       {1, {0.004281378056590748, 0.9497068978577179}},
      {10, {0.029516394846410082, 0.9234204220349895}}, {29, {0.1, 0.85}},
      {30, {0.09994965352845243, 0.8500503466729342}},  {31, {0.09979871550490317, 0.850201285300238}},
      {50, {0.0793893450575732, 0.8706107373853763}},   {99, {4e-07, 0.95}}};
  Problem p;
  tl::OneCycle schedule(tl::OneCycleOptions::pytorch(0.1));
  for (const auto& [k, expected] : sgd) {
    auto v = scheduled(schedule, p.optimizer, k, 100);
    BOOST_TEST(v.learning_rate == expected[0], boost::test_tools::tolerance(1e-9));
    BOOST_TEST(*v.momentum == expected[1], boost::test_tools::tolerance(1e-9));
  }
  //   OneCycleLR(Adam, max_lr=0.01, total_steps=37, pct_start=0.25, div_factor=10,
  //   final_div_factor=100): lr and beta1 per step.
  const std::map<int64_t, std::array<double, 2>> adam{{0, {0.0009999999999999992, 0.95}},
                                                      {5, {0.006971805834928397, 0.8836466018341289}},
                                                      {8, {0.009979623651578881, 0.8502264038713457}},
                                                      {9, {0.00998200545526992, 0.8501801255728737}},
                                                      {20, {0.006195101664158709, 0.8880870704288417}},
                                                      {36, {1e-05, 0.95}}};
  torch::manual_seed(0);
  Mlp net;
  torch::optim::Adam adam_optimizer(net->parameters(), torch::optim::AdamOptions(0.1));
  tl::OneCycle adam_schedule(tl::OneCycleOptions::pytorch(0.01).pct_start(0.25).div(10).div_final(10 * 100));
  for (const auto& [k, expected] : adam) {
    auto v = scheduled(adam_schedule, adam_optimizer, k, 37);
    BOOST_TEST(v.learning_rate == expected[0], boost::test_tools::tolerance(1e-9));
    BOOST_TEST(*v.momentum == expected[1], boost::test_tools::tolerance(1e-9));
  }
}

BOOST_AUTO_TEST_CASE(flat_cos_cosine_warmup_and_multi_step_follow_their_formulas) {
  Problem p(0.2);
  tl::FlatCos flat(tl::FlatCosOptions(0.2));
  // fastai fit_flat_cos: flat for 75% of the steps, then SchedCos(lr, lr/1e5).
  for (int64_t k : {0, 29, 30, 35, 39}) {
    const double pos = k / 40.0;
    const double expected = pos < 0.75 ? 0.2 : fastai_cos(0.2, 0.2 / 1e5, (pos - 0.75) / 0.25);
    BOOST_TEST(scheduled(flat, p.optimizer, k, 40).learning_rate == expected, boost::test_tools::tolerance(1e-12));
  }
  tl::CosineWarmup warm(tl::CosineWarmupOptions(0.2).warmup_steps(4).min_lr(0.01));
  BOOST_TEST(scheduled(warm, p.optimizer, 0, 20).learning_rate == 0.0);
  BOOST_TEST(scheduled(warm, p.optimizer, 2, 20).learning_rate == 0.1, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(scheduled(warm, p.optimizer, 4, 20).learning_rate == 0.2, boost::test_tools::tolerance(1e-12));
  // Half-way through the decay (step 4 + 15/2): the mean of 0.2 and 0.01.
  BOOST_TEST(scheduled(warm, p.optimizer, 19, 20).learning_rate == 0.01, boost::test_tools::tolerance(1e-12));
  // Multi-step in a fit: 6 epochs with milestones {2, 4}, gamma 0.5: epochs 1-2 at lr, 3-4 at lr/2, 5-6 at lr/4.
  Problem q(0.2);
  auto loop = make_loop(q);
  auto history = loop.fit(6, {std::make_shared<tl::MultiStep>(std::vector<int64_t>{2, 4}, 0.5)});
  const std::vector<double> expected{0.2, 0.2, 0.1, 0.1, 0.05, 0.05};
  for (size_t e = 0; e < 6; ++e) BOOST_TEST(history.epochs[e].learning_rate == expected[e], boost::test_tools::tolerance(1e-12));
}

BOOST_AUTO_TEST_CASE(schedules_keep_param_group_ratios_and_edge_cases_stay_finite) {
  // Two param groups at 0.1 and 0.01: the schedule drives the first, the second keeps a tenth.
  torch::manual_seed(0);
  Mlp net;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(net->fc1->parameters(), std::make_unique<torch::optim::SGDOptions>(0.1));
  groups.emplace_back(net->fc3->parameters(), std::make_unique<torch::optim::SGDOptions>(0.01));
  torch::optim::SGD optimizer(groups, torch::optim::SGDOptions(0.1));
  tl::OneCycle schedule(tl::OneCycleOptions(1.0));
  scheduled(schedule, optimizer, 10, 40);
  BOOST_TEST(tl::learning_rate_of(optimizer, 0) == 1.0, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(tl::learning_rate_of(optimizer, 1) == 0.1, boost::test_tools::tolerance(1e-12));
  // PyTorch positions with a warm-up under one step (pct_start 0.25 of 4 steps): finite, the peak first.
  Problem p;
  tl::OneCycle tiny(tl::OneCycleOptions::pytorch(0.1).pct_start(0.25));
  BOOST_TEST(scheduled(tiny, p.optimizer, 0, 4).learning_rate == 0.1, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(std::isfinite(scheduled(tiny, p.optimizer, 3, 4).learning_rate));
  // Reduce-on-plateau stops counting once the lr sits at min_lr.
  Problem q(0.2);
  auto loop = make_loop(q);
  auto plateau = std::make_shared<tl::ReduceOnPlateau>(tl::ReduceOnPlateauOptions("lr").patience(0).factor(0.5).min_lr(0.1));
  loop.fit(5, {plateau});
  BOOST_TEST(tl::learning_rate_of(q.optimizer) == 0.1, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(plateau->reductions() == 1);
}

BOOST_AUTO_TEST_CASE(schedules_reject_options_out_of_range_by_name) {
  BOOST_TEST(error_of([] { tl::OneCycle(tl::OneCycleOptions(0.1).pct_start(1.5)); }).find("pct_start is 1.5") != std::string::npos);
  BOOST_TEST(error_of([] { tl::MultiStep({3, 2}); }).find("increasing order") != std::string::npos);
  BOOST_TEST(error_of([] { tl::EarlyStopping(tl::EarlyStoppingOptions().patience(0)); }).find("patience is 0") !=
             std::string::npos);
  BOOST_TEST(error_of([] { tl::parse_precision("fp8"); }).find("precision is 'fp8'; expected fp32, bf16 or fp16") !=
             std::string::npos);
}

// ---- Schedules in fits: the loop counts the steps; every mode agrees; resume continues --------

BOOST_AUTO_TEST_CASE(one_cycle_in_a_fit_gets_the_true_step_count_and_records_every_step) {
  // 160 samples, batch 8, accumulation 2: 10 optimizer steps per epoch, 3 epochs = 30 steps.
  Problem p;
  auto loop = make_loop(p, small_options().grad_accumulation_steps(2).record_steps(true));
  auto history = loop.fit(3, {std::make_shared<tl::OneCycle>(tl::OneCycleOptions(0.1))});
  BOOST_REQUIRE(history.steps.size() == 30u);
  for (int64_t k = 0; k < 30; ++k) {
    BOOST_TEST(history.steps[k].step == k + 1);
    BOOST_TEST(history.steps[k].learning_rate == fastai_one_cycle_lr(k, 30, 0.1), boost::test_tools::tolerance(1e-12));
    BOOST_TEST(*history.steps[k].momentum == fastai_one_cycle_momentum(k, 30), boost::test_tools::tolerance(1e-12));
    BOOST_TEST(std::isfinite(history.steps[k].loss));
  }
  BOOST_TEST(history.epochs[2].learning_rate == history.steps[29].learning_rate);
  BOOST_TEST(*history.epochs[0].momentum == *history.steps[9].momentum);
}

BOOST_AUTO_TEST_CASE(the_same_schedule_in_single_and_dp_sets_the_same_lr_at_every_step) {
  Problem a, b;
  auto single = make_loop(a, small_options().record_steps(true));
  auto dp = make_loop<tl::gpu_mode::DataParallel>(b, small_options().record_steps(true), tl::gpu_mode::DataParallel::cpu_replicas(2));
  auto ha = single.fit(2, {std::make_shared<tl::OneCycle>(tl::OneCycleOptions(0.1))});
  auto hb = dp.fit(2, {std::make_shared<tl::OneCycle>(tl::OneCycleOptions(0.1))});
  BOOST_REQUIRE(ha.steps.size() == hb.steps.size());
  for (size_t k = 0; k < ha.steps.size(); ++k) BOOST_TEST(ha.steps[k].learning_rate == hb.steps[k].learning_rate);
  // The step loss in dp is the whole batch's (both replicas' shards), as in single.
  BOOST_TEST(ha.steps[0].loss == hb.steps[0].loss, boost::test_tools::tolerance(1e-5));
}

BOOST_AUTO_TEST_CASE(a_run_resumed_mid_schedule_ends_bit_for_bit_as_an_uninterrupted_one) {
  for (const char* kind : {"one-cycle", "plateau+early-stop"}) {
    auto callbacks_for = [&](const fs::path& dir) {
      tl::CallbackList callbacks;
      if (std::string(kind) == "one-cycle") {
        callbacks.push_back(std::make_shared<tl::OneCycle>(tl::OneCycleOptions(0.1)));
      } else {
        callbacks.push_back(std::make_shared<tl::ReduceOnPlateau>(tl::ReduceOnPlateauOptions("lr").patience(0).factor(0.5)));
        callbacks.push_back(std::make_shared<tl::EarlyStopping>(tl::EarlyStoppingOptions("val_loss").patience(10)));
      }
      // Mid-epoch checkpoints for the schedule; for the epoch-end callbacks a checkpoint at each
      // epoch's end, given FIRST: it must still hold their state after that epoch (runs_after_others).
      if (!dir.empty() && std::string(kind) == "one-cycle") {
        callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir).every_n_steps(7)));
      } else if (!dir.empty()) {
        callbacks.insert(callbacks.begin(), std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir).every_n_epochs(1)));
      }
      return callbacks;
    };
    Problem whole;
    auto reference = make_loop(whole);
    auto expected_history = reference.fit(4, callbacks_for({}));
    const auto expected = flat_params(whole.net->parameters());

    TempDir dir;
    {
      Problem first;
      auto loop = make_loop(first);
      // 4 epochs of 20 steps; stop after step 47 (the newest checkpoint: step 42, or epoch 2's end).
      struct StopAt : tl::Callback {
        void on_step_end(tl::TrainState& s) override {
          if (s.global_step == 47) throw std::runtime_error("simulated crash");
        }
      };
      auto callbacks = callbacks_for(dir.path);
      callbacks.push_back(std::make_shared<StopAt>());
      BOOST_CHECK_THROW(loop.fit(4, callbacks), std::runtime_error);
    }
    Problem second;
    auto resumed = make_loop(second);
    auto history = resumed.fit(4, callbacks_for(dir.path), "last");
    BOOST_TEST_MESSAGE(kind << ": max |resumed - uninterrupted| = "
                            << (flat_params(second.net->parameters()) - expected).abs().max().item<double>());
    BOOST_TEST(torch::equal(flat_params(second.net->parameters()), expected));
    BOOST_REQUIRE(history.epochs.size() == expected_history.epochs.size());
    for (size_t e = 0; e < history.epochs.size(); ++e) {
      BOOST_TEST(history.epochs[e].learning_rate == expected_history.epochs[e].learning_rate);
    }
  }
}

// ---- Early stopping and reduce-on-plateau -------------------------------------------------------

BOOST_AUTO_TEST_CASE(early_stopping_stops_after_patience_epochs_and_restores_the_best_weights) {
  // "lr" is constant without a schedule: epoch 1 is the best, none after improves, so with
  // patience 3 the fit stops after epoch 4, and the weights of epoch 1 come back.
  Problem p;
  auto loop = make_loop(p);
  struct KeepEpoch1 : tl::Callback {
    torch::Tensor weights;
    void on_epoch_end(tl::TrainState& s, const tl::EpochRecord&) override {
      if (s.epoch == 1) weights = flat_params(s.model->parameters()).clone();
    }
  };
  auto keep = std::make_shared<KeepEpoch1>();
  auto stop = std::make_shared<tl::EarlyStopping>(tl::EarlyStoppingOptions("lr").patience(3).restore_best_weights(true));
  auto history = loop.fit(20, {keep, stop});
  BOOST_TEST(history.epochs.size() == 4u);
  BOOST_TEST(stop->stopped_epoch() == 4);
  BOOST_TEST(stop->best_epoch() == 1);
  BOOST_TEST(history.stop_reason.find("EarlyStopping: lr did not improve for 3 epochs") != std::string::npos);
  BOOST_TEST(torch::equal(flat_params(p.net->parameters()), keep->weights));
  // min_delta: an accuracy that must rise by more than 2 (impossible) stops after patience epochs.
  Problem q;
  auto loop2 = make_loop(q);
  auto h2 = loop2.fit(20, {std::make_shared<tl::EarlyStopping>(
                             tl::EarlyStoppingOptions("val_accuracy").mode(tl::MonitorMode::Max).patience(2).min_delta(2.0))});
  BOOST_TEST(h2.epochs.size() == 3u);
  // A monitor the epoch does not measure is named with the ones it does.
  Problem r;
  auto loop3 = make_loop(r);
  BOOST_TEST(error_of([&] { loop3.fit(1, {std::make_shared<tl::EarlyStopping>(tl::EarlyStoppingOptions("val_f1"))}); })
                 .find("EarlyStopping monitors 'val_f1', which epoch 1 did not measure; expected one of: train_loss, "
                       "train_accuracy, val_loss, val_accuracy, lr") != std::string::npos);
}

BOOST_AUTO_TEST_CASE(reduce_on_plateau_lowers_the_lr_after_patience_bad_epochs) {
  // Monitoring "lr" (min): epoch 1 sets the best; epochs 2 and 3 are bad; after epoch 3 (2 > patience 1)
  // the lr halves; epoch 4 at lr/2 improves; 5, 6 bad; after 6 the lr halves again.
  Problem p(0.2);
  auto loop = make_loop(p);
  auto plateau = std::make_shared<tl::ReduceOnPlateau>(tl::ReduceOnPlateauOptions("lr").patience(1).factor(0.5));
  auto history = loop.fit(6, {plateau});
  const std::vector<double> expected{0.2, 0.2, 0.2, 0.1, 0.1, 0.1};
  for (size_t e = 0; e < 6; ++e) BOOST_TEST(history.epochs[e].learning_rate == expected[e], boost::test_tools::tolerance(1e-12));
  BOOST_TEST(tl::learning_rate_of(p.optimizer) == 0.05, boost::test_tools::tolerance(1e-12));
  BOOST_TEST(plateau->reductions() == 2);
}

// ---- Mixed precision ----------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(bf16_autocast_runs_the_forward_in_bf16_and_trains_as_well_as_fp32) {
  struct Probe : MlpImpl {
    at::ScalarType seen = at::kFloat;
    torch::Tensor forward(torch::Tensor x) {
      auto hidden = fc1(x);
      seen = hidden.scalar_type();
      return fc3(torch::tanh(fc2(torch::tanh(hidden))));
    }
  };
  std::map<std::string, double> accuracy;
  for (auto precision : {tl::Precision::fp32, tl::Precision::bf16}) {
    torch::manual_seed(5);
    auto net = std::make_shared<Probe>();
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    tl::TrainLoop<Probe> loop(net, make_data(800, 1), make_data(400, 2), optimizer, torch::nn::CrossEntropyLoss(),
                              small_options().batch_size(32).precision(precision));
    auto history = loop.fit(5);
    accuracy[tl::to_string(precision)] = history.last().validation->metrics.at("accuracy");
    BOOST_TEST((net->seen == (precision == tl::Precision::bf16 ? at::kBFloat16 : at::kFloat)));
    for (const auto& p : net->parameters()) BOOST_TEST((p.scalar_type() == at::kFloat));  // weights stay fp32
  }
  BOOST_TEST_MESSAGE("accuracy fp32 " << accuracy["fp32"] << ", bf16 " << accuracy["bf16"]);
  BOOST_TEST(accuracy["fp32"] > 0.85);
  BOOST_TEST(std::abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01);
  // Autocast is off again in this thread after the loop.
  BOOST_TEST(!tl::detail::autocast_setting(c10::DeviceType::CPU).enabled);
}

BOOST_AUTO_TEST_CASE(fp16_on_the_cpu_is_refused_with_the_device_named) {
  Problem p;
  auto loop = make_loop(p, small_options().precision(tl::Precision::fp16));
  BOOST_TEST(error_of([&] { loop.fit(1); }).find("precision is fp16 and the model trains on cpu; expected a CUDA device") !=
             std::string::npos);
}

BOOST_AUTO_TEST_CASE(grad_scaler_unscales_skips_on_inf_backs_off_and_grows) {
  tl::GradScaler scaler(tl::GradScalerOptions().growth_interval(3));
  BOOST_TEST(scaler.scale() == 65536.0);
  auto w = torch::zeros({4}, torch::requires_grad());
  w.mutable_grad() = torch::tensor({65536.0f, -131072.0f, 32768.0f, 0.0f});
  BOOST_TEST(!scaler.unscale({w}));
  BOOST_TEST(torch::equal(w.grad(), torch::tensor({1.0f, -2.0f, 0.5f, 0.0f})));
  scaler.update(false);
  scaler.update(false);
  BOOST_TEST(scaler.scale() == 65536.0);
  scaler.update(false);  // the third good step in a row: growth
  BOOST_TEST(scaler.scale() == 131072.0);
  BOOST_TEST(scaler.growth_tracker() == 0);
  for (float bad : {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    w.mutable_grad() = torch::tensor({1.0f, bad, 1.0f, 1.0f});
    BOOST_TEST(scaler.unscale({w}));  // found
    scaler.update(true);
  }
  BOOST_TEST(scaler.scale() == 32768.0);  // backed off twice
  BOOST_TEST(scaler.skipped_steps() == 2);
  tl::GradScaler restored;
  restored.load_state(scaler.state());
  BOOST_TEST(restored.scale() == 32768.0);
  BOOST_TEST(restored.skipped_steps() == 2);
}

// ---- The learning-rate finder -------------------------------------------------------------------

template <class Mode>
void check_lr_find_leaves_no_trace(Mode mode) {
  // Two loops fit one epoch; one then runs lr_find. Their next epochs must end bit for bit the
  // same: weights, optimizer state, progress and random streams were all put back.
  Problem probed;
  auto loop = make_loop<Mode>(probed, small_options(), mode);
  loop.fit(1);
  Problem again;
  auto plain2 = make_loop<Mode>(again, small_options(), mode);
  plain2.fit(1);
  const auto before = flat_params(probed.net->parameters());
  auto found = loop.lr_find(tl::LrFinderOptions().num_steps(40).end_lr(1e4));
  BOOST_TEST(torch::equal(flat_params(probed.net->parameters()), before));
  BOOST_TEST(loop.history().epochs.size() == 1u);
  BOOST_TEST(tl::learning_rate_of(probed.optimizer) == 0.05);
  loop.fit(1);
  plain2.fit(1);
  BOOST_TEST(torch::equal(flat_params(probed.net->parameters()), flat_params(again.net->parameters())));

  BOOST_TEST(found.learning_rates.size() == found.losses.size());
  BOOST_TEST(found.learning_rates.front() == 1e-7, boost::test_tools::tolerance(1e-12));
  for (size_t i = 1; i < found.learning_rates.size(); ++i) {
    BOOST_TEST(found.learning_rates[i] / found.learning_rates[i - 1] == std::pow(1e11, 1.0 / 39), boost::test_tools::tolerance(1e-9));
  }
  BOOST_TEST(found.diverged);  // SGD with momentum diverges well before lr 1e4 on this problem
  BOOST_TEST(found.learning_rates.size() < 40u);
  BOOST_TEST(found.valley > 1e-6);
  BOOST_TEST(found.valley < found.learning_rates.back());
  BOOST_TEST_MESSAGE("lr_find: " << found.learning_rates.size() << " steps, valley " << found.valley << ", steepest "
                                 << found.steepest << ", minimum/10 " << found.minimum_tenth);
}

BOOST_AUTO_TEST_CASE(lr_find_returns_a_curve_and_suggestion_and_leaves_no_trace_in_single_and_dp) {
  check_lr_find_leaves_no_trace(tl::gpu_mode::Single());
  check_lr_find_leaves_no_trace(tl::gpu_mode::DataParallel::cpu_replicas(2));
}

BOOST_AUTO_TEST_CASE(lr_find_suggestions_match_fastai_on_a_known_curve) {
  // Flat, then falling faster and faster from step 10 to 30, then rising; lrs 1e-7 .. 10 over 50 steps.
  std::vector<double> lrs, losses;
  for (int i = 0; i < 50; ++i) {
    lrs.push_back(1e-7 * std::pow(1e8, i / 49.0));
    losses.push_back(i < 10 ? 2.0 : i <= 30 ? 2.0 - 0.002 * (i - 10) * (i - 10) : 1.2 + 0.2 * (i - 30));
  }
  auto found = tl::suggest_learning_rates(lrs, losses, 50);
  // Expected indices from fastai 2.7's valley / steep (fastai.callback.schedule), run in Python on
  // this curve: both drop the first 50 // 10 and the last 5 points.
  BOOST_TEST(found.valley == lrs[19], boost::test_tools::tolerance(1e-12));
  BOOST_TEST(found.steepest == lrs[29], boost::test_tools::tolerance(1e-12));
  BOOST_TEST(found.minimum_tenth == lrs[30] / 10, boost::test_tools::tolerance(1e-12));
}

// ---- MixUp --------------------------------------------------------------------------------------

BOOST_AUTO_TEST_CASE(mixup_blends_inputs_and_targets_reproducibly_and_the_loss_is_the_blend_of_losses) {
  tl::MixUp mixup(tl::MixUpOptions(0.4).num_classes(3).seed(7));
  tl::TrainState state;
  state.global_step = 12;
  auto x = torch::randn({16, 6}, at::detail::createCPUGenerator(3));
  auto y = torch::randint(0, 3, {16}, at::detail::createCPUGenerator(4));
  auto input = x.clone(), target = y.clone();
  mixup.on_train_batch(state, input, target);
  BOOST_TEST((target.sizes() == torch::IntArrayRef{16, 3}));
  BOOST_TEST(torch::allclose(target.sum(1), torch::ones({16})));
  // λ_i is the soft target's weight of sample i's own label, at least 0.5; the input is
  // λ_i x_i + (1 − λ_i) x_j for the partner j whose label holds the rest.
  for (int64_t i = 0; i < 16; ++i) {
    const double lambda = target[i][y[i].item<int64_t>()].item<double>();
    BOOST_TEST(lambda >= 0.5);
    bool explained = false;
    for (int64_t j = 0; j < 16 && !explained; ++j) {
      explained = torch::allclose(input[i], lambda * x[i] + (1 - lambda) * x[j], 1e-5, 1e-5) || lambda == 1.0;
    }
    BOOST_TEST(explained);
  }
  // Same seed, rank and step: the same mix; another step: another one.
  auto input2 = x.clone(), target2 = y.clone();
  mixup.on_train_batch(state, input2, target2);
  BOOST_TEST(torch::equal(input, input2));
  state.global_step = 13;
  auto input3 = x.clone(), target3 = y.clone();
  mixup.on_train_batch(state, input3, target3);
  BOOST_TEST(!torch::equal(input, input3));
  // Cross-entropy of the soft target = λ CE(y_i) + (1 − λ) CE(y_j), per sample.
  auto logits = torch::randn({16, 3}, at::detail::createCPUGenerator(5));
  auto soft_loss = torch::nn::functional::cross_entropy(logits, target);
  auto per_sample = -(torch::log_softmax(logits, 1) * target).sum(1).mean();
  BOOST_TEST(soft_loss.item<double>() == per_sample.item<double>(), boost::test_tools::tolerance(1e-6));
  // In a fit it trains, with training accuracy counted against each sample's own label.
  Problem p;
  auto loop = make_loop(p);
  auto history = loop.fit(3, {std::make_shared<tl::MixUp>(tl::MixUpOptions(0.4).num_classes(3))});
  BOOST_TEST(history.last().train_metrics.at("accuracy") > 0.4);
  BOOST_TEST(history.last().validation->metrics.at("accuracy") > 0.6);
  // The class count learnt from the data (a TensorDataset given num_classes 3): the same training.
  Problem q;
  auto loop2 = make_loop(q);
  auto learned = loop2.fit(3, {tl::MixUp(0.4)});
  BOOST_TEST(learned.last().train_loss == history.last().train_loss);
  BOOST_TEST(torch::equal(flat_params(q.net->parameters()), flat_params(p.net->parameters())));
  // A dataset that does not say its classes, and no num_classes: a clear error.
  Problem r;
  auto labelled = make_data(160, 1);
  tl::TrainLoop<Mlp> loop3(r.net, tl::data::TensorDataset(labelled.inputs(), labelled.targets()), {}, r.optimizer,
                           torch::nn::CrossEntropyLoss(), small_options());
  BOOST_TEST(error_of([&] { loop3.fit(1, {tl::MixUp()}); }).find("MixUp got class labels, num_classes 0 and a training "
                                                                  "dataset that does not say its classes") != std::string::npos);
}

// ---- DDP: 2 and 3 ranks -------------------------------------------------------------------------

namespace {

struct WorkerResult {
  int exit_code = -1;
  std::string output;
  fs::path dir;
};

WorkerResult run_worker(const std::string& scenario, int world, const std::string& env = "") {
  WorkerResult run;
  run.dir = fs::temp_directory_path() / ("tl_recipe_" + scenario + "_" + std::to_string(world) + "_" + std::to_string(::getpid()));
  fs::remove_all(run.dir);
  fs::create_directories(run.dir / "tmp");
  const std::string command = "TMPDIR=" + (run.dir / "tmp").string() + " " + env + " " + test_program("ddp_worker") + " " + scenario + " " +
                              std::to_string(world) + " " + run.dir.string() + " 0 2>&1";
  FILE* pipe = ::popen(command.c_str(), "r");
  std::array<char, 4096> buffer{};
  while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) run.output.append(buffer.data(), n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

std::vector<double> read_numbers(const fs::path& path) {
  std::ifstream in(path);
  std::vector<double> values;
  for (double v; in >> v;) values.push_back(v);
  return values;
}

}  // namespace

BOOST_AUTO_TEST_CASE(one_cycle_under_ddp_sets_the_same_lr_on_every_rank_as_in_one_process) {
  for (int world : {2, 3}) {
    auto run = run_worker("one_cycle", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    // 2 epochs of 5 steps per rank (the sharded data): 10 steps.
    for (int r = 0; r < world; ++r) {
      auto lrs = read_numbers(run.dir / ("lrs_rank" + std::to_string(r) + ".txt"));
      BOOST_REQUIRE(lrs.size() == 10u);
      for (int64_t k = 0; k < 10; ++k) BOOST_TEST(lrs[k] == fastai_one_cycle_lr(k, 10, 0.1), boost::test_tools::tolerance(1e-12));
    }
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(early_stopping_under_ddp_stops_every_rank_at_the_same_step) {
  for (int world : {2, 3}) {
    auto run = run_worker("early_stop", world);
    BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
    // patience 2 on a constant "lr": stops after epoch 3, 5 steps per epoch, on every rank.
    for (int r = 0; r < world; ++r) {
      auto steps = read_numbers(run.dir / ("stop_rank" + std::to_string(r) + ".txt"));
      BOOST_REQUIRE(steps.size() == 2u);
      BOOST_TEST(steps[0] == 15);  // global step
      BOOST_TEST(steps[1] == 3);   // epochs
    }
    fs::remove_all(run.dir);
  }
}

BOOST_AUTO_TEST_CASE(lr_find_under_ddp_gives_the_caller_the_curve_and_leaves_the_model_as_it_was) {
  auto run = run_worker("lr_find", 2);
  BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
  auto values = read_numbers(run.dir / "lr_find.txt");
  BOOST_REQUIRE(values.size() == 3u);
  BOOST_TEST(values[0] >= 2);    // steps recorded
  BOOST_TEST(values[1] > 1e-7);  // valley
  BOOST_TEST(values[2] == 0);    // max |params after - before|
  fs::remove_all(run.dir);
}

BOOST_AUTO_TEST_CASE(sync_batchnorm_under_ddp_equals_one_process_with_the_combined_batch) {
  // One epoch, batch 4 per rank: 20 samples per rank (5 steps); with 2 ranks also 19 each (a last
  // batch of 3 per rank). Shards of different sizes are in the next test: DDP averages the ranks'
  // gradients with equal weights, so uneven last batches differ from one process anyway.
  for (int world : {2, 3}) {
    for (int64_t samples : {int64_t{4} * world * 5, world == 2 ? int64_t{38} : int64_t{0}}) {
      if (samples == 0) continue;
      torch::manual_seed(5);
      BnMlp net;
      torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      tl::TrainLoop<BnMlp> single(net, make_data(samples, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                  tl::TrainLoopOptions().batch_size(4 * world).shuffle(false));
      single.fit(1);
      const auto expected = flat_state(*net);
      std::map<int, double> difference;
      for (int sync : {1, 0}) {
        auto run = run_worker("sync_bn", world, "TL_TEST_SYNC_BN=" + std::to_string(sync) + " TL_TEST_SAMPLES=" + std::to_string(samples));
        BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
        torch::Tensor state;
        torch::load(state, (run.dir / "bn_state.pt").string());
        difference[sync] = (state - expected).abs().max().item<double>();
        fs::remove_all(run.dir);
      }
      BOOST_TEST_MESSAGE("world " << world << ", " << samples << " samples: max |ddp - single| with sync_batchnorm "
                                  << difference[1] << ", without " << difference[0]);
      BOOST_TEST(difference[1] <= 1e-5);
      BOOST_TEST(difference[0] > 1e-3);  // per-rank statistics: not the same training
    }
  }
}

BOOST_AUTO_TEST_CASE(sync_batchnorm_weighs_uneven_shards_by_their_samples_in_forward_and_backward) {
  // Two "ranks" in two threads hold 5 and 3 of 8 samples; their SyncBatchNorm layers reduce through
  // an in-process all-reduce. Outputs, input gradients, running statistics and the sum of the
  // parameter gradients equal one batch-norm over all 8 samples.
  torch::manual_seed(11);
  const auto x = torch::randn({8, 4, 3}) * 2 + 1;
  const auto loss_weights = torch::randn({8, 4, 3});
  auto reference_layer = tl::nn::SyncBatchNorm(torch::nn::BatchNormOptions(4).momentum(0.2));
  reference_layer->weight.data().uniform_(0.5, 1.5);
  reference_layer->bias.data().uniform_(-0.5, 0.5);
  auto reference_input = x.clone().requires_grad_(true);
  auto reference_output = reference_layer(reference_input);
  (reference_output * loss_weights).sum().backward();

  static thread_local int party = 0;
  std::array<torch::Tensor, 2> slots;
  std::barrier sync(2);
  tl::nn::detail::SyncBatchNormScope scope([&](torch::Tensor& values) {
    slots[party] = values.clone();
    sync.arrive_and_wait();
    auto total = slots[0] + slots[1];
    sync.arrive_and_wait();
    values.copy_(total);
  });
  const std::array<int64_t, 2> starts{0, 5}, counts{5, 3};
  std::array<torch::Tensor, 2> outputs, input_grads;
  std::array<std::shared_ptr<tl::nn::SyncBatchNormImpl>, 2> layers;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    layers[r] = std::dynamic_pointer_cast<tl::nn::SyncBatchNormImpl>(reference_layer->clone());
    layers[r]->running_mean.zero_();
    layers[r]->running_var.fill_(1.0);
    layers[r]->num_batches_tracked.zero_();
    for (auto& p : layers[r]->parameters()) p.mutable_grad() = torch::Tensor();
  }
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      party = r;
      auto input = x.narrow(0, starts[r], counts[r]).clone().requires_grad_(true);
      outputs[r] = layers[r]->forward(input);
      (outputs[r] * loss_weights.narrow(0, starts[r], counts[r])).sum().backward();
      input_grads[r] = input.grad();
    });
  }
  for (auto& t : threads) t.join();
  const auto tol = [](const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); };
  BOOST_TEST(tol(torch::cat({outputs[0], outputs[1]}).detach(), reference_output.detach()) <= 1e-5);
  BOOST_TEST(tol(torch::cat({input_grads[0], input_grads[1]}), reference_input.grad()) <= 1e-5);
  for (int r = 0; r < 2; ++r) {
    BOOST_TEST(tol(layers[r]->running_mean, reference_layer->running_mean) <= 1e-6);
    BOOST_TEST(tol(layers[r]->running_var, reference_layer->running_var) <= 1e-6);
  }
  BOOST_TEST(tol(layers[0]->weight.grad() + layers[1]->weight.grad(), reference_layer->weight.grad()) <= 1e-5);
  BOOST_TEST(tol(layers[0]->bias.grad() + layers[1]->bias.grad(), reference_layer->bias.grad()) <= 1e-5);
}
