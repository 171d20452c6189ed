#define BOOST_TEST_MODULE test_data_parallel
#include "unit_test.hpp"

#include "test_support.hpp"

#include <trainloop/gpu_mode/data_parallel.hpp>
#include <trainloop/trainloop.hpp>

#include <ATen/Parallel.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <set>
#include <string>
#include <thread>

namespace tl = trainloop;
using DP = tl::gpu_mode::DataParallel;

namespace {

/// A linearly separable 3-class problem: the class is the argmax of a fixed projection.
tl::data::TensorDataset blobs(int64_t n, uint64_t seed) {
  auto x = torch::randn({n, 8}, at::detail::createCPUGenerator(seed));
  auto projection = torch::randn({8, 3}, at::detail::createCPUGenerator(1234));
  return tl::data::TensorDataset(x, x.matmul(projection).argmax(1), 3);
}

/// A plain module (not Cloneable): DataParallel default-constructs its replicas.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Net);

/// A Cloneable module whose shape comes from a constructor argument: DataParallel clones it.
struct CloneNetImpl : torch::nn::Cloneable<CloneNetImpl> {
  explicit CloneNetImpl(int64_t hidden = 16) : hidden(hidden) { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(8, hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::tanh(fc1(x))); }
  int64_t hidden;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(CloneNet);

/// Linear -> BatchNorm1d -> ReLU -> Linear.
struct BnNetImpl : torch::nn::Module {
  BnNetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 6));
    bn = register_module("bn", torch::nn::BatchNorm1d(6));
    fc2 = register_module("fc2", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(BnNet);

/// Its width comes from a constructor argument but it is not Cloneable: replicas cannot be built.
struct SizedImpl : torch::nn::Module {
  explicit SizedImpl(int64_t width = 16) { fc = register_module("fc", torch::nn::Linear(8, width)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(Sized);

struct NoDefaultImpl : torch::nn::Module {
  explicit NoDefaultImpl(int64_t width) { fc = register_module("fc", torch::nn::Linear(8, width)); }
  torch::Tensor forward(torch::Tensor x) { return fc(x); }
  torch::nn::Linear fc{nullptr};
};
static_assert(tl::detail::cloneable_module_v<CloneNetImpl> && tl::detail::replicable_module_v<CloneNetImpl>);
static_assert(!tl::detail::cloneable_module_v<NetImpl> && tl::detail::replicable_module_v<NetImpl>);
static_assert(!tl::detail::replicable_module_v<NoDefaultImpl>);  // TrainLoop<..., DataParallel> would not compile

torch::Tensor flat_parameters(torch::nn::Module& module) {
  std::vector<torch::Tensor> flat;
  for (const auto& p : module.parameters()) flat.push_back(p.detach().flatten());
  return torch::cat(flat);
}

double max_abs_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).abs().max().item<double>();
}

tl::TrainLoopOptions sgd_options(int64_t batch) {
  return tl::TrainLoopOptions().batch_size(batch).shuffle(false).metrics({std::make_shared<tl::Accuracy>()});
}

/// Trains a freshly seeded model in `Mode` and returns it with its history.
template <class Model, class Mode>
std::pair<Model, tl::History> train(Mode mode, tl::TrainLoopOptions options, const tl::data::TensorDataset& data,
                                    int64_t steps, tl::data::AnyDataset<> validation = {}) {
  torch::manual_seed(42);
  Model net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  tl::TrainLoop<Model, Mode> loop(net, data, validation, optimizer, torch::nn::CrossEntropyLoss(), options, mode);
  auto history = loop.fit(tl::FitLength::iterations(steps));
  return {net, history};
}

int process_thread_count() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}

/// Waits for the thread count to come back to `expected` (exiting threads linger briefly); the
/// limit of 60 s only bounds a hang, it is not a speed goal.
int thread_count_settling_at(int expected) {
  for (int i = 0; i < 6000 && process_thread_count() != expected; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return process_thread_count();
}

}  // namespace

BOOST_AUTO_TEST_CASE(shards_are_contiguous_and_differ_by_at_most_one) {
  BOOST_TEST(tl::detail::shard_sizes(7, 3) == std::vector<int64_t>({3, 2, 2}), boost::test_tools::per_element());
  BOOST_TEST(tl::detail::shard_sizes(9, 3) == std::vector<int64_t>({3, 3, 3}), boost::test_tools::per_element());
  BOOST_TEST(tl::detail::shard_sizes(2, 3) == std::vector<int64_t>({1, 1}), boost::test_tools::per_element());
  BOOST_TEST(tl::detail::shard_sizes(5, 1) == std::vector<int64_t>({5}), boost::test_tools::per_element());
  auto batch = torch::data::Example<>(torch::arange(14).view({7, 2}), torch::arange(7));
  auto shards = tl::detail::split_example_batch(batch, 3);
  BOOST_REQUIRE_EQUAL(shards.size(), 3u);
  BOOST_TEST(shards[1].data[0][0].item<int64_t>() == 6);  // rows 3, 4 go to replica 1
  BOOST_TEST(shards[2].target.size(0) == 2);
  BOOST_TEST(shards[2].target[1].item<int64_t>() == 6);
}

BOOST_AUTO_TEST_CASE(matches_single_device_training_with_2_and_3_replicas) {
  // 33 samples in batches of 7: 7, 7, 7, 7, 5 -> split 4+3 over 2 replicas, 3+2+2 (last 2+2+1) over 3.
  // (1 replica: DataParallel's machinery with nothing to split or reduce.)
  const auto data = blobs(33, 1);
  auto [single_plain, h1] = train<Net>(tl::gpu_mode::Single(), sgd_options(7), data, 5);
  auto [single_clone, h2] = train<CloneNet>(tl::gpu_mode::Single(), sgd_options(7), data, 5);
  for (int replicas : {1, 2, 3}) {
    auto [dp_plain, h3] = train<Net>(DP::cpu_replicas(replicas), sgd_options(7), data, 5);
    auto [dp_clone, h4] = train<CloneNet>(DP::cpu_replicas(replicas), sgd_options(7), data, 5);
    const double plain = max_abs_difference(flat_parameters(*single_plain), flat_parameters(*dp_plain));
    const double cloned = max_abs_difference(flat_parameters(*single_clone), flat_parameters(*dp_clone));
    BOOST_TEST_MESSAGE(replicas << " replicas, batch 7, 5 SGD-momentum steps: max |single - dp| = " << plain
                                << " (default-constructed replicas), " << cloned << " (cloned replicas)");
    BOOST_TEST(h3.total_steps == 5);
    BOOST_TEST(plain <= 1e-5);
    BOOST_TEST(cloned <= 1e-5);
    // The weights moved: the comparison is not between two untouched models.
    torch::manual_seed(42);
    BOOST_TEST(max_abs_difference(flat_parameters(*Net()), flat_parameters(*dp_plain)) > 1e-2);
  }
}

BOOST_AUTO_TEST_CASE(matches_single_device_training_with_gradient_accumulation) {
  // 66 samples in batches of 7 (last one 3, split 1+1+1), 2 micro-batches per step: 5 steps.
  const auto data = blobs(66, 2);
  auto [single, hs] = train<Net>(tl::gpu_mode::Single(), sgd_options(7).grad_accumulation_steps(2), data, 5);
  auto [dp, hd] = train<Net>(DP::cpu_replicas(3), sgd_options(7).grad_accumulation_steps(2), data, 5);
  const double difference = max_abs_difference(flat_parameters(*single), flat_parameters(*dp));
  BOOST_TEST_MESSAGE("3 replicas, batch 7, accumulation 2, 5 steps: max |single - dp| = " << difference);
  BOOST_TEST(hd.total_steps == 5);
  BOOST_TEST(difference <= 1e-5);
}

BOOST_AUTO_TEST_CASE(losses_and_metrics_match_single_device) {
  const auto data = blobs(33, 3);
  tl::data::AnyDataset<> validation = blobs(29, 4);  // eval batches of 7: the last has 1 sample, 1 shard
  auto [single, hs] = train<Net>(tl::gpu_mode::Single(), sgd_options(7), data, 10, validation);
  auto [dp, hd] = train<Net>(DP::cpu_replicas(3), sgd_options(7), data, 10, validation);
  BOOST_REQUIRE_EQUAL(hs.epochs.size(), hd.epochs.size());
  for (size_t e = 0; e < hs.epochs.size(); ++e) {
    const auto& s = hs.epochs[e];
    const auto& d = hd.epochs[e];
    BOOST_TEST_MESSAGE("epoch " << e + 1 << ": val loss single " << s.validation->loss << " dp " << d.validation->loss
                                << ", val accuracy single " << s.validation->metrics.at("accuracy") << " dp "
                                << d.validation->metrics.at("accuracy"));
    BOOST_TEST(std::abs(s.validation->loss - d.validation->loss) <= 1e-6);
    BOOST_TEST(std::abs(s.validation->metrics.at("accuracy") - d.validation->metrics.at("accuracy")) <= 1e-6);
    BOOST_TEST(d.validation->samples == 29);
    BOOST_TEST(std::abs(s.train_loss - d.train_loss) <= 1e-6);
    BOOST_TEST(std::abs(s.train_metrics.at("accuracy") - d.train_metrics.at("accuracy")) <= 1e-6);
    BOOST_TEST(d.samples == 33);
  }
}

BOOST_AUTO_TEST_CASE(batchnorm_uses_per_replica_batch_statistics_and_replica_0_running_statistics) {
  // 2 replicas, batches of 8 -> shards of 4. What the policy documents, simulated by hand: each
  // shard normalised with its own statistics, gradients of (loss_0 + loss_1) / 2 summed, running
  // statistics updated from shard 0 only.
  const auto data = blobs(24, 5);
  const auto x = data.inputs();
  const auto y = data.targets();
  const double lr = 0.1, momentum = 0.9;

  torch::manual_seed(7);
  BnNet simulated;
  BnNet shard1_copy;  // plays replica 1: same weights as `simulated` before every step
  torch::optim::SGD optimizer(simulated->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
  auto predicted_mean = simulated->bn->running_mean.clone();
  auto predicted_var = simulated->bn->running_var.clone();
  for (int64_t step = 0; step < 3; ++step) {
    {
      torch::NoGradGuard no_grad;
      auto source = simulated->named_parameters(), target = shard1_copy->named_parameters();
      for (const auto& item : source) target[item.key()].copy_(item.value());
    }
    auto x0 = x.narrow(0, 8 * step, 4), y0 = y.narrow(0, 8 * step, 4);
    auto x1 = x.narrow(0, 8 * step + 4, 4), y1 = y.narrow(0, 8 * step + 4, 4);
    {
      // BatchNorm's momentum formula, from shard 0's pre-normalisation activations.
      torch::NoGradGuard no_grad;
      auto h0 = simulated->fc1(x0);
      predicted_mean = 0.9 * predicted_mean + 0.1 * h0.mean(0);
      predicted_var = 0.9 * predicted_var + 0.1 * h0.var(0, /*unbiased=*/true);
    }
    optimizer.zero_grad();
    shard1_copy->zero_grad();
    (0.5 * torch::nn::functional::cross_entropy(simulated->forward(x0), y0)).backward();
    (0.5 * torch::nn::functional::cross_entropy(shard1_copy->forward(x1), y1)).backward();
    {
      torch::NoGradGuard no_grad;
      auto mine = simulated->parameters(), theirs = shard1_copy->parameters();
      for (size_t i = 0; i < mine.size(); ++i) mine[i].mutable_grad().add_(theirs[i].grad());
    }
    optimizer.step();
  }

  auto train_bn = [&](auto mode) {
    torch::manual_seed(7);
    BnNet net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(lr).momentum(momentum));
    tl::TrainLoop<BnNet, decltype(mode)> loop(net, data, {}, opt, torch::nn::CrossEntropyLoss(),
                                              tl::TrainLoopOptions().batch_size(8).shuffle(false), mode);
    loop.fit(1);
    // Evaluation with the trained model: in DP every replica normalises with its copy of the
    // running statistics, so the result equals evaluating the caller's model alone.
    auto dp_eval = loop.evaluate(data);
    return std::make_pair(net, dp_eval.loss);
  };
  auto [dp, dp_eval_loss] = train_bn(DP::cpu_replicas(2));
  auto [single, single_eval_loss] = train_bn(tl::gpu_mode::Single());

  torch::NoGradGuard no_grad;
  const double parameters = max_abs_difference(flat_parameters(*simulated), flat_parameters(*dp));
  const double mean = max_abs_difference(predicted_mean, dp->bn->running_mean);
  const double var = max_abs_difference(predicted_var, dp->bn->running_var);
  BOOST_TEST_MESSAGE("BatchNorm, 2 replicas, 3 steps: max |simulated - dp| parameters " << parameters << ", running_mean "
                                                                                        << mean << ", running_var " << var);
  BOOST_TEST(parameters <= 1e-5);
  BOOST_TEST(mean <= 1e-5);
  BOOST_TEST(var <= 1e-5);
  BOOST_TEST(dp->bn->num_batches_tracked.item<int64_t>() == 3);
  // Single-device training differs (whole-batch statistics), by far more than the tolerance.
  const double vs_single_parameters = max_abs_difference(flat_parameters(*single), flat_parameters(*dp));
  const double vs_single_mean = max_abs_difference(single->bn->running_mean, dp->bn->running_mean);
  BOOST_TEST_MESSAGE("  for comparison, max |single - dp| parameters " << vs_single_parameters << ", running_mean "
                                                                       << vs_single_mean);
  BOOST_TEST(vs_single_parameters > 1e-3);
  BOOST_TEST(vs_single_mean > 1e-3);

  // Every replica evaluated with replica 0's running statistics (24 samples over 3 batches of 8,
  // 4 per replica): the same loss as the caller's model on one device.
  dp->eval();
  const double direct_loss = torch::nn::functional::cross_entropy(dp->forward(x), y).item<double>();
  BOOST_TEST_MESSAGE("  eval loss dp " << dp_eval_loss << ", caller's model alone " << direct_loss);
  BOOST_TEST(std::abs(dp_eval_loss - direct_loss) <= 1e-6);
  (void)single_eval_loss;
}

namespace {
/// Throws from forward() when its input contains the marker value.
struct MarkerNetImpl : torch::nn::Module {
  MarkerNetImpl() { fc = register_module("fc", torch::nn::Linear(8, 3)); }
  torch::Tensor forward(torch::Tensor x) {
    if ((x == 999.0f).any().item<bool>()) throw std::runtime_error("marker 999 seen in this shard");
    TORCH_CHECK(!(x == -999.0f).any().item<bool>(), "a TORCH_CHECK failed on marker -999");
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(MarkerNet);
}  // namespace

BOOST_AUTO_TEST_CASE(a_worker_exception_names_its_replica_and_no_thread_is_left) {
  // libtorch's lazily started threads exist before the baseline: this thread's OpenMP team, and
  // where a GPU is, the CUDA driver's thread that the loop's first look for CUDA starts and keeps
  // (one thread on an H200, 2026-11-30; without it here the count never came back to the baseline).
  auto warm_up = torch::randn({256, 256});
  warm_up.matmul(warm_up).sum();
  tl::detail::capture_rng_state();  // what the loop touches of CUDA: is_available() and its generators
  const int baseline_threads = process_thread_count();
  auto clean = blobs(12, 6);
  auto x = clean.inputs().clone();
  x[5][0] = 999.0f;  // batch 0 = samples 0..5 -> shards {0,1} {2,3} {4,5}: replica 2
  auto poisoned = tl::data::TensorDataset(x, clean.targets(), 3);
  auto x2 = clean.inputs().clone();
  x2[8][3] = -999.0f;  // batch 1 = samples 6..11 -> sample 8 is in replica 1's shard
  auto checked = tl::data::TensorDataset(x2, clean.targets(), 3);
  {
    torch::manual_seed(1);
    MarkerNet net;
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    tl::TrainLoop<MarkerNet, DP> loop(net, poisoned, {}, optimizer, torch::nn::CrossEntropyLoss(),
                                      tl::TrainLoopOptions().batch_size(6).shuffle(false), DP::cpu_replicas(3));
    auto message = error_of([&] { loop.fit(1); });
    BOOST_TEST_MESSAGE("worker error: " << message);
    BOOST_TEST(message.find("DataParallel replica 2 (device cpu) failed during training") != std::string::npos, message);
    BOOST_TEST(message.find("marker 999 seen in this shard") != std::string::npos, message);
    BOOST_TEST(process_thread_count() >= baseline_threads + 3);  // the 3 workers, still waiting for work

    // A libtorch error keeps its type (c10::Error), with the replica named in its context.
    std::string torch_error = "<no c10::Error was thrown>";
    try {
      loop.evaluate(checked);
    } catch (const c10::Error& error) {
      torch_error = error.what_without_backtrace();
    }
    BOOST_TEST_MESSAGE("worker c10::Error: " << torch_error);
    BOOST_TEST(torch_error.find("DataParallel replica 1 (device cpu) failed during evaluation") != std::string::npos,
               torch_error);
    BOOST_TEST(torch_error.find("a TORCH_CHECK failed on marker -999") != std::string::npos, torch_error);

    // The engine survives a failed batch: evaluating clean data gives the caller's model's loss.
    const double dp_loss = loop.evaluate(clean).loss;
    torch::NoGradGuard no_grad;
    const double direct = torch::nn::functional::cross_entropy(net->forward(clean.inputs()), clean.targets()).item<double>();
    BOOST_TEST(std::abs(dp_loss - direct) <= 1e-6);
  }
  BOOST_TEST(thread_count_settling_at(baseline_threads) == baseline_threads);  // every worker joined
}

namespace {
/// Records the intra-op thread count and the thread of every forward call.
struct ThreadProbeImpl : torch::nn::Module {
  ThreadProbeImpl() { fc = register_module("fc", torch::nn::Linear(8, 3)); }
  torch::Tensor forward(torch::Tensor x) {
    {
      std::lock_guard<std::mutex> lock(*mutex);
      counts->insert(at::get_num_threads());
      blas_counts->insert(tl::detail::OpenBlasThreads::loaded().get());
      threads->insert(std::this_thread::get_id());
    }
    return fc(x);
  }
  torch::nn::Linear fc{nullptr};
  // Shared by every replica (default-constructed replicas get the same static objects).
  static inline auto mutex = std::make_shared<std::mutex>();
  static inline auto counts = std::make_shared<std::set<int>>();
  static inline auto blas_counts = std::make_shared<std::set<int>>();  // 0 without OpenBLAS
  static inline auto threads = std::make_shared<std::set<std::thread::id>>();
};
}  // namespace

BOOST_AUTO_TEST_CASE(replica_threads_split_the_cores_without_touching_the_callers_count) {
  using Probe = ThreadProbeImpl;
  const int caller_threads = at::get_num_threads();
  auto run = [&](DP mode) {
    Probe::counts->clear();
    Probe::blas_counts->clear();
    Probe::threads->clear();
    auto net = std::make_shared<Probe>();
    torch::optim::SGD optimizer(net->parameters(), 0.1);
    tl::TrainLoop<Probe, DP> loop(net, blobs(60, 7), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                  tl::TrainLoopOptions().batch_size(6), mode);
    loop.fit(1);  // 10 batches
  };

  run(DP::cpu_replicas(3).threads_per_replica(2));
  BOOST_TEST_MESSAGE("caller's intra-op threads " << caller_threads << "; workers with threads_per_replica(2) saw "
                                                  << *Probe::counts->begin());
  BOOST_TEST((*Probe::counts == std::set<int>{2}));
  BOOST_TEST(Probe::threads->size() == 3u);  // persistent: the same 3 threads for all 10 batches
  BOOST_TEST(!Probe::threads->count(std::this_thread::get_id()));
  BOOST_TEST(at::get_num_threads() == caller_threads);
  int fresh_thread_count = 0;
  std::thread([&] { fresh_thread_count = at::get_num_threads(); }).join();
  BOOST_TEST(fresh_thread_count == caller_threads);  // the process default was restored

  run(DP::cpu_replicas(2));
  const int automatic = std::getenv("OMP_NUM_THREADS") ? caller_threads
                                                       : std::max(1, trainloop::cpu::usable_cpu_count() / 2);
  BOOST_TEST_MESSAGE("automatic, 2 replicas on " << trainloop::cpu::usable_cpu_count() << " usable cores: workers saw "
                                                 << *Probe::counts->begin() << " (expected " << automatic << ")");
  BOOST_TEST((*Probe::counts == std::set<int>{automatic}));
  BOOST_TEST(at::get_num_threads() == caller_threads);

  // OpenBLAS's process-wide pool is set to the per-replica count while replicas run, then restored.
  const auto& blas = tl::detail::OpenBlasThreads::loaded();
  const int caller_blas = blas.get();
  run(DP::cpu_replicas(2).threads_per_replica(1));
  BOOST_TEST_MESSAGE("OpenBLAS " << (blas.available() ? "loaded" : "not loaded") << ": " << caller_blas
                                 << " threads outside batches, " << *Probe::blas_counts->begin()
                                 << " inside with threads_per_replica(1)");
  BOOST_TEST((*Probe::counts == std::set<int>{1}));
  BOOST_TEST((*Probe::blas_counts == std::set<int>{blas.available() ? 1 : 0}));
  BOOST_TEST(blas.get() == caller_blas);
}

BOOST_AUTO_TEST_CASE(a_default_constructed_replica_with_other_shapes_is_a_clear_error) {
  torch::manual_seed(3);
  Sized net(5);  // the default constructor would build width 16
  torch::optim::SGD optimizer(net->parameters(), 0.1);
  tl::TrainLoop<Sized, DP> loop(net, blobs(20, 8), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                tl::TrainLoopOptions().batch_size(5), DP::cpu_replicas(2));
  auto message = error_of([&] { loop.fit(1); });
  BOOST_TEST(message.find("'fc.weight' has shape [5, 8] but a default-constructed module's has shape [16, 8]") !=
                 std::string::npos,
             message);
  BOOST_TEST(message.find("torch::nn::Cloneable") != std::string::npos, message);
}

BOOST_AUTO_TEST_CASE(the_policy_checks_its_devices) {
  auto empty = error_of([] { DP(std::vector<torch::Device>{}).validate(); });
  BOOST_TEST(empty.find("empty device list") != std::string::npos, empty);
  auto zero = error_of([] { DP::cpu_replicas(0); });
  BOOST_TEST(zero.find("cpu_replicas(0)") != std::string::npos, zero);
  BOOST_TEST(DP::cpu_replicas(3).devices().size() == 3u);
  DP({torch::Device(torch::kCPU), torch::Device(torch::kCPU)}).validate();  // a repeated device is fine
  if (!torch::cuda::is_available()) {
    BOOST_TEST(DP().devices().size() == 2u);
    BOOST_TEST(DP().devices()[1].is_cpu());
    auto cuda = error_of([] { DP({torch::Device("cuda:0"), torch::Device("cuda:1")}).validate(); });
    BOOST_TEST(cuda.find("CUDA is not available") != std::string::npos, cuda);
  } else {
    BOOST_TEST(DP().devices().size() == trainloop::detail::cuda_device_count());
  }
  BOOST_TEST(std::string(DP::name) == "dp");
}

namespace {
/// A batch type of its own, with the split() hook DataParallel needs.
struct PairBatch {
  torch::Tensor features, labels;
  int64_t batch_size() const { return features.size(0); }
  PairBatch to(torch::Device device) const { return {features.to(device), labels.to(device)}; }
  std::vector<PairBatch> split(int64_t parts) const {
    std::vector<PairBatch> shards;
    auto f = features.tensor_split(std::min(parts, batch_size()));
    auto l = labels.tensor_split(std::min(parts, batch_size()));
    for (size_t i = 0; i < f.size(); ++i) shards.push_back({f[i], l[i]});
    return shards;
  }
};

struct PairDataset : torch::data::datasets::BatchDataset<PairDataset, PairBatch> {
  explicit PairDataset(tl::data::TensorDataset data) : data(std::move(data)) {}
  PairBatch get_batch(c10::ArrayRef<size_t> indices) override {
    auto example = data.get_batch(indices);
    return {example.data, example.target};
  }
  c10::optional<size_t> size() const override { return data.size(); }
  tl::data::TensorDataset data;
};

/// The custom contract: the model computes its own loss and predictions from a PairBatch.
struct PairNetImpl : torch::nn::Module {
  PairNetImpl() { fc = register_module("fc", torch::nn::Linear(8, 3)); }
  torch::Tensor batch_loss(const PairBatch& batch, tl::Criterion& criterion) {
    return criterion(fc(batch.features), batch.labels);
  }
  tl::Predictions batch_predictions(const PairBatch& batch) { return {fc(batch.features), batch.labels}; }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(PairNet);
}  // namespace

BOOST_AUTO_TEST_CASE(a_batch_type_with_split_is_trained_like_on_one_device) {
  auto run = [](auto mode) {
    torch::manual_seed(9);
    PairNet net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
    tl::TrainLoop<PairNet, decltype(mode), PairBatch> loop(net, PairDataset(blobs(35, 9)), PairDataset(blobs(10, 10)),
                                                           optimizer, torch::nn::CrossEntropyLoss(),
                                                           tl::TrainLoopOptions().batch_size(7).shuffle(false), mode);
    auto history = loop.fit(1);
    return std::make_pair(flat_parameters(*net), history.last().validation->loss);
  };
  auto [single, single_loss] = run(tl::gpu_mode::Single());
  auto [dp, dp_loss] = run(DP::cpu_replicas(3));
  const double difference = max_abs_difference(single, dp);
  BOOST_TEST_MESSAGE("custom batch type, 3 replicas, 5 steps: max |single - dp| = " << difference);
  BOOST_TEST(difference <= 1e-5);
  BOOST_TEST(std::abs(single_loss - dp_loss) <= 1e-6);
}
