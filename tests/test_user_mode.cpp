#define BOOST_TEST_MODULE test_user_mode
#include "unit_test.hpp"

// A gpu_mode defined entirely in this file joins TrainLoop's run-time switch (gpu_mode::AnyOf)
// with nothing under include/ edited for it; and the loop's traps a user meets are clear errors.

#include <trainloop/trainloop.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>

namespace tl = trainloop;

// ---- A user's mode: "split", every micro-batch run as `parts` sequential chunks on one device
// (a memory saver: the activations of one chunk at a time). Each chunk's loss is weighted by
// its share of the samples, so the gradients equal one pass over the whole micro-batch.
template <class Module>
class SplitEngine;

struct SplitBatches {
  static constexpr const char* name = "split";
  template <class Module>
  using engine = SplitEngine<Module>;
  int64_t parts = 3;
};

/// A one-process engine: the identity members (rank 0 of 1, collectives of one) are OneProcessEngine's.
template <class Module>
class SplitEngine : public tl::OneProcessEngine {
 public:
  SplitEngine(const SplitBatches& mode, std::shared_ptr<Module> module) : parts_(mode.parts), module_(std::move(module)) {}
  /// How many chunks each micro-batch is run as (read by the flags test).
  int64_t parts() const { return parts_; }

  template <class Batch, class Forward, class Sink>
  void train_micro_batch(const Batch& batch, Forward&& forward, double loss_scale, bool, Sink&& sink) {
    const int64_t n = batch.data.size(0);
    for (const auto& chunk : chunks(batch)) {
      tl::StepOutput out = forward(*module_, chunk);
      (out.loss * (loss_scale * static_cast<double>(out.samples) / static_cast<double>(n))).backward();
      sink(out);
    }
  }
  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    torch::NoGradGuard no_grad;
    for (const auto& chunk : chunks(batch)) sink(forward(*module_, chunk));
  }

 private:
  std::vector<torch::data::Example<>> chunks(const torch::data::Example<>& batch) const {
    std::vector<torch::data::Example<>> parts;
    const auto inputs = batch.data.chunk(parts_);
    const auto targets = batch.target.chunk(parts_);
    for (size_t i = 0; i < inputs.size(); ++i) parts.push_back({inputs[i], targets[i]});
    return parts;
  }
  int64_t parts_;
  std::shared_ptr<Module> module_;
};

using Modes = tl::gpu_mode::AnyOf<tl::gpu_mode::Single, tl::gpu_mode::DataParallel,
                                  tl::gpu_mode::DistributedDataParallel, SplitBatches>;

/// The flags of "split" (mode_from_flags finds it beside SplitBatches): `--parts N` in ModeFlags::extra.
void apply_mode_flags(SplitBatches& mode, const tl::ModeFlags& flags) {
  if (auto parts = flags.extra.find("parts"); parts != flags.extra.end()) mode.parts = std::stoll(parts->second);
}

struct Blobs {
  torch::Tensor x, y;
  Blobs() {
    auto generator = at::detail::createCPUGenerator(11);
    x = torch::randn({96, 6}, generator);
    y = (x.narrow(1, 0, 3).sum(1) > 0).to(torch::kLong) + (x.narrow(1, 3, 3).sum(1) > 0).to(torch::kLong);
  }
};

torch::nn::Sequential make_net() {
  torch::manual_seed(5);
  return torch::nn::Sequential(torch::nn::Linear(6, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
}

torch::Tensor flat(const torch::nn::Module& net) {
  std::vector<torch::Tensor> all;
  for (const auto& p : net.parameters()) all.push_back(p.detach().reshape({-1}));
  return torch::cat(all);
}

// Trains with the mode named `name`, chosen at run time; returns the parameters.
torch::Tensor train_with(const std::string& name) {
  Blobs data;
  auto net = make_net();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.2));
  tl::TrainLoop<torch::nn::Sequential, Modes> loop(net, tl::data::TensorDataset(data.x, data.y), {}, optimizer,
                                                   torch::nn::CrossEntropyLoss(),
                                                   tl::TrainLoopOptions().batch_size(12).seed(3), Modes::parse(name));
  const auto history = loop.fit(3);
  BOOST_TEST(history.epochs.size() == 3u);
  BOOST_TEST(history.last().samples == 96);
  return flat(*net);
}

BOOST_AUTO_TEST_CASE(a_mode_defined_in_a_test_file_trains_through_the_run_time_switch) {
  const torch::Tensor single = train_with("single");
  const torch::Tensor split = train_with("split");
  const double difference = (single - split).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |single - split| after 3 epochs: " << difference);
  BOOST_TEST(difference < 1e-6);
  BOOST_TEST((single - flat(*make_net())).abs().max().item<double>() > 1e-2);  // it trained
  BOOST_TEST(Modes::names() == "single, dp, ddp, split");
  BOOST_TEST(Modes(SplitBatches{}).name() == "split");
  try {
    Modes::parse("zero");
    BOOST_FAIL("an unknown mode name was accepted");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("unknown gpu mode 'zero'; expected one of: single, dp, ddp, split") !=
               std::string::npos);
  }
}

// mode_from_flags chooses a user's mode by name among the modes given, and sets it up with the
// user's apply_mode_flags; the built-in modes keep theirs, and the shared checks still apply.
BOOST_AUTO_TEST_CASE(mode_from_flags_chooses_and_sets_up_a_users_mode) {
  tl::ModeFlags flags;
  flags.gpu_mode = "split";
  flags.extra["parts"] = "4";
  const Modes chosen = tl::mode_from_flags<Modes>(flags);
  BOOST_TEST(chosen.name() == "split");
  BOOST_TEST(std::get<SplitBatches>(chosen.get()).parts == 4);
  flags.gpu_mode = "single";
  flags.device = "cpu";
  BOOST_TEST(std::get<tl::gpu_mode::Single>(tl::mode_from_flags<Modes>(flags).get()).device() == torch::Device("cpu"));
  flags.gpu_mode = "split";
  flags.comm_hook = "fp16";
  try {
    tl::mode_from_flags<Modes>(flags);
    BOOST_FAIL("a comm hook was accepted with a user's one-process mode");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("comm hook is 'fp16' with gpu mode 'split'; expected gpu mode ddp") !=
               std::string::npos);
  }
}

// ---- The seams of a sharded mode (engine/optional_members.hpp): an engine that clips by a norm it
// computes itself and writes the optimizer state in its own layout, as a ZeRO rank would (the
// norm from per-shard sums of squares; the state as one sub-archive per shard).
struct ShardedCalls {
  int clips = 0, saves = 0, loads = 0;
  double last_norm = 0.0;
};
ShardedCalls sharded_calls;

template <class Module>
class ShardedStateEngine;

struct ShardedState {
  static constexpr const char* name = "sharded-state";
  template <class Module>
  using engine = ShardedStateEngine<Module>;
};

template <class Module>
class ShardedStateEngine : public SplitEngine<Module> {
 public:
  ShardedStateEngine(const ShardedState&, std::shared_ptr<Module> module)
      : SplitEngine<Module>(SplitBatches{1}, std::move(module)) {}

  void clip_grad_norm(Module& module, double max_norm) {
    ++sharded_calls.clips;
    const std::vector<torch::Tensor> parameters = module.parameters();
    double shard_squares[2] = {0.0, 0.0};  // shard s: the s-th half of the parameter list
    for (size_t i = 0; i < parameters.size(); ++i) {
      shard_squares[i * 2 / parameters.size()] += parameters[i].grad().pow(2).sum().item<double>();
    }
    sharded_calls.last_norm = std::sqrt(shard_squares[0] + shard_squares[1]);
    const double coefficient = max_norm / (sharded_calls.last_norm + 1e-6);
    if (coefficient >= 1.0) return;
    torch::NoGradGuard no_grad;
    for (auto& p : parameters) p.grad().mul_(coefficient);
  }
  void save_optimizer_state(const torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive,
                            bool writes) {
    ++sharded_calls.saves;
    if (!writes) return;
    torch::serialize::OutputArchive shard;
    optimizer.save(shard);
    archive.write("shards", c10::IValue(int64_t{1}));
    archive.write("shard0", shard);
  }
  void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    ++sharded_calls.loads;
    torch::serialize::InputArchive shard;
    if (!archive.try_read("shard0", shard)) throw tl::CheckpointError("no optimizer shard 0; expected shards");
    optimizer.load(shard);
  }
};

// Trains `epochs` with Adam and gradient clipping in mode `Mode`; `resume` continues a checkpoint.
template <class Mode>
torch::Tensor clipped_adam(int64_t epochs, const std::filesystem::path& checkpoints = {}, const std::string& resume = {},
                           int64_t then_epochs = 0) {
  Blobs data;
  auto net = make_net();
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(0.05));
  tl::TrainLoop<torch::nn::Sequential, Mode> loop(net, tl::data::TensorDataset(data.x, data.y), {}, optimizer,
                                                  torch::nn::CrossEntropyLoss(),
                                                  tl::TrainLoopOptions().batch_size(12).seed(3).clip_grad_norm(0.05));
  if (!checkpoints.empty()) {
    loop.fit(epochs, {tl::ModelCheckpoint(tl::ModelCheckpointOptions(checkpoints))});
  } else {
    loop.fit(epochs, {}, resume);
  }
  if (then_epochs > 0) loop.fit(then_epochs);
  return flat(*net);
}

BOOST_AUTO_TEST_CASE(a_sharded_mode_clips_and_checkpoints_the_optimizer_through_its_own_members) {
  sharded_calls = {};
  const torch::Tensor single = clipped_adam<tl::gpu_mode::Single>(2);
  const torch::Tensor sharded = clipped_adam<ShardedState>(2);
  BOOST_TEST_MESSAGE("max |single - sharded-state| after 2 clipped epochs: " << (single - sharded).abs().max().item<double>());
  BOOST_TEST((single - sharded).abs().max().item<double>() < 1e-6);
  BOOST_TEST(sharded_calls.clips == 16);             // 96 samples, batch 12: 8 steps per epoch
  BOOST_TEST(sharded_calls.last_norm > 0.05);        // the clipping was active
  BOOST_TEST(sharded_calls.saves == 0);

  // Checkpoints hold the engine's layout, and a resumed run equals an uninterrupted one bit for bit.
  const auto dir = std::filesystem::temp_directory_path() / ("trainloop_sharded_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const torch::Tensor uninterrupted = clipped_adam<ShardedState>(2, dir, {}, /*then_epochs=*/1);
  BOOST_TEST(sharded_calls.saves == 2);  // one checkpoint per epoch of the first fit
  const auto file = tl::checkpoint_candidates(dir).front();
  torch::serialize::InputArchive archive, ours, optimizer_part, shard;
  archive.load_from(file.string());
  BOOST_REQUIRE(archive.try_read("__trainloop__", ours) && ours.try_read("optimizer", optimizer_part));
  BOOST_TEST(optimizer_part.try_read("shard0", shard));
  torch::Tensor groups;
  BOOST_TEST(!optimizer_part.try_read("param_groups/size", groups));  // not libtorch's layout at the top

  const torch::Tensor resumed = clipped_adam<ShardedState>(1, {}, file.string());
  BOOST_TEST(sharded_calls.loads == 1);
  BOOST_TEST(torch::equal(resumed, uninterrupted));
  // A loop of the default layout refuses the file clearly instead of running without Adam's state.
  try {
    clipped_adam<tl::gpu_mode::Single>(1, {}, file.string());
    BOOST_FAIL("a checkpoint in the sharded layout was loaded as libtorch's");
  } catch (const tl::CheckpointError& error) {
    BOOST_TEST_MESSAGE(error.what());
    BOOST_TEST(std::string(error.what()).find("holds the optimizer state in the layout of gpu mode 'sharded-state'") !=
               std::string::npos);
  }
  std::filesystem::remove_all(dir);
}

// ---- The optimizer step as one engine call (engine/optimizer_step.hpp): a mode that owns the
// whole step, here by skipping every second one and wrapping the default for the others.
struct StepCalls {
  bool skip_even = false;
  int steps = 0, skipped = 0, callback_looks = 0;
  std::vector<double> rates;  // what default_optimizer_step reported
};
StepCalls step_calls;

template <class Module>
class EveryOtherStepEngine;

struct EveryOtherStep {
  static constexpr const char* name = "every-other-step";
  template <class Module>
  using engine = EveryOtherStepEngine<Module>;
};

template <class Module>
class EveryOtherStepEngine : public SplitEngine<Module> {
 public:
  EveryOtherStepEngine(const EveryOtherStep&, std::shared_ptr<Module> module)
      : SplitEngine<Module>(SplitBatches{1}, std::move(module)) {}

  tl::OptimizerStepResult optimizer_step(const tl::OptimizerStepRequest<Module>& request) {
    if (++step_calls.steps % 2 == 0 && step_calls.skip_even) {  // drop this window's gradients
      request.optimizer.zero_grad();
      ++step_calls.skipped;
      return {tl::learning_rate_of(request.optimizer), tl::momentum_of(request.optimizer), true};
    }
    const tl::OptimizerStepResult result = tl::default_optimizer_step(*this, request);
    step_calls.rates.push_back(result.learning_rate);
    return result;
  }
};

// Sets the learning rate before each step (as a schedule does) and counts its looks.
struct RisingRate : tl::Callback {
  void on_before_optimizer_step(tl::TrainState& state) override {
    ++step_calls.callback_looks;
    tl::set_learning_rate(*state.optimizer, 0.05 * static_cast<double>(state.step + 1));
  }
};

template <class Mode>
torch::Tensor rising_rate_sgd(int64_t epochs) {
  Blobs data;
  auto net = make_net();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.2));
  tl::TrainLoop<torch::nn::Sequential, Mode> loop(net, tl::data::TensorDataset(data.x, data.y), {}, optimizer,
                                                  torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(12).seed(3));
  const auto history = loop.fit(epochs, {RisingRate()});
  BOOST_TEST(history.total_steps == 8 * epochs);  // the loop counts every window, skipped or not
  return flat(*net);
}

BOOST_AUTO_TEST_CASE(a_mode_owns_the_whole_optimizer_step_and_can_wrap_the_default) {
  const torch::Tensor single = rising_rate_sgd<tl::gpu_mode::Single>(2);
  step_calls = {};
  const torch::Tensor wrapped = rising_rate_sgd<EveryOtherStep>(2);
  BOOST_TEST(step_calls.steps == 16);  // one engine call per step: 96 samples, batch 12, 2 epochs
  BOOST_TEST(step_calls.callback_looks == 16);
  BOOST_TEST(torch::equal(wrapped, single));  // the default, wrapped: bit for bit the same training
  BOOST_REQUIRE(step_calls.rates.size() == 16u);
  BOOST_TEST(step_calls.rates.front() == 0.05);  // read after the callbacks' look, as the step used it
  BOOST_TEST(step_calls.rates.back() == 0.05 * 16);

  step_calls = {};
  step_calls.skip_even = true;
  const torch::Tensor skipping = rising_rate_sgd<EveryOtherStep>(2);
  BOOST_TEST(step_calls.steps == 16);
  BOOST_TEST(step_calls.skipped == 8);
  BOOST_TEST(step_calls.callback_looks == 8);  // the engine's own steps skip the default's sequence
  BOOST_TEST((skipping - single).abs().max().item<double>() > 1e-3);
  BOOST_TEST((skipping - flat(*make_net())).abs().max().item<double>() > 1e-3);  // half the steps still trained
}

// ---- No silent traps.
struct PairBatch {
  torch::Tensor left, target;
  int64_t batch_size() const { return target.size(0); }
};
class PairDataset : public torch::data::datasets::BatchDataset<PairDataset, PairBatch> {
 public:
  PairBatch get_batch(c10::ArrayRef<size_t> indices) override {
    return {torch::ones({static_cast<int64_t>(indices.size()), 2}), torch::zeros({static_cast<int64_t>(indices.size()), 1})};
  }
  c10::optional<size_t> size() const override { return 8; }
};
struct PairModelImpl : torch::nn::Module {
  torch::nn::Linear linear{register_module("linear", torch::nn::Linear(2, 1))};
  torch::Tensor batch_loss(const PairBatch& batch, tl::Criterion& criterion) { return criterion(linear(batch.left), batch.target); }
  tl::Predictions batch_predictions(const PairBatch& batch) { return {linear(batch.left), batch.target}; }
};
TORCH_MODULE(PairModel);

BOOST_AUTO_TEST_CASE(mixup_with_a_batch_type_it_cannot_mix_is_refused_at_the_start_of_fit) {
  PairModel model;
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<PairModel, tl::gpu_mode::Single, PairBatch> loop(model, PairDataset(), {}, optimizer,
                                                                 torch::nn::MSELoss(), tl::TrainLoopOptions().batch_size(4));
  try {
    loop.fit(1, {tl::MixUp(0.1)});
    BOOST_FAIL("MixUp with PairBatch batches was accepted");
  } catch (const tl::ConfigurationError& error) {
    const std::string text = error.what();
    BOOST_TEST_MESSAGE(text);
    BOOST_TEST(text.find("callback trainloop::MixUp changes batches in on_train_batch") != std::string::npos);
    BOOST_TEST(text.find("PairBatch") != std::string::npos);
  }
  BOOST_TEST(loop.history().epochs.empty());  // nothing trained
  loop.fit(1, {tl::ProgressBar()});            // callbacks by value; the same loop trains without MixUp
  BOOST_TEST(loop.history().epochs.size() == 1u);
}

// A callback with state that a checkpoint never saw is an error; one declaring it optional is not.
struct Counter : tl::Callback {
  int64_t steps = 0;
  void on_step_end(tl::TrainState&) override { ++steps; }
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("steps", torch::tensor(steps));
  }
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor value;
    archive.read("steps", value);
    steps = value.item<int64_t>();
  }
};
struct OptionalCounter : Counter {
  bool state_optional() const override { return true; }
};

BOOST_AUTO_TEST_CASE(a_callback_state_missing_from_a_checkpoint_is_an_error_unless_optional) {
  const auto dir = std::filesystem::temp_directory_path() / ("trainloop_user_mode_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  Blobs data;
  auto net = make_net();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<torch::nn::Sequential> loop(net, tl::data::TensorDataset(data.x, data.y), {}, optimizer,
                                            torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(32));
  auto checkpoint = std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir));
  loop.fit(1, {checkpoint, tl::EarlyStopping(tl::EarlyStoppingOptions("train_loss"))});
  const auto file = checkpoint->candidates().front();

  auto counter = std::make_shared<Counter>();
  try {
    loop.fit(1, {counter}, file.string());
    BOOST_FAIL("a checkpoint without Counter's state was accepted");
  } catch (const tl::CheckpointError& error) {
    const std::string text = error.what();
    BOOST_TEST_MESSAGE(text);
    // The callback's name is its type's, with the namespaces it is declared in ("...::Counter").
    BOOST_TEST(text.find("holds no state for callback \"") != std::string::npos);
    BOOST_TEST(text.find("Counter\"; it holds the states of") != std::string::npos);
    BOOST_TEST(text.find("trainloop::EarlyStopping") != std::string::npos);  // the keys present
  }
  BOOST_TEST(loop.history().epochs.size() == 1u);  // all or nothing: the failed resume changed nothing
  auto optional = std::make_shared<OptionalCounter>();
  loop.fit(1, {optional, tl::ProgressBar()}, file.string());  // a stateless ProgressBar is fine too
  BOOST_TEST(optional->steps == 3);                           // 96 samples, batch 32: one epoch
  BOOST_TEST(loop.history().epochs.size() == 2u);
  std::filesystem::remove_all(dir);
}
