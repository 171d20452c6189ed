#define BOOST_TEST_MODULE test_cuda
#include "unit_test.hpp"

// The CUDA and NCCL paths (../shared GPU checklist items 2-4): a 1-rank NCCL process group
// through the same code as multi-GPU DDP (NCCL refuses two ranks on one GPU), the bucketed
// reducer on CUDA gradients, exact evaluation sums, and single vs dp (1 device) vs ddp (1 rank)
// giving the same parameters. On a machine without CUDA every case is skipped, and ctest reports
// the program as Skipped: what it proves is only proven where a GPU ran it (README "Verified on GPU").

#include "ddp_test_model.hpp"

#include <trainloop/interop/dcp_weights.hpp>
#include <trainloop/interop/safetensors_weights.hpp>
#include <trainloop/trainloop.hpp>

#include <cstdlib>
#include <functional>
#include <tuple>
#include <iostream>
#include <filesystem>
#include <unistd.h>
#include <limits>
#include <map>
#include <vector>
#include <string>

namespace tl = trainloop;
namespace distributed = trainloop::distributed;

namespace {

/// Precondition of every case: a CUDA device. Without one the case is reported as skipped, and
/// the marker makes ctest report the program as Skipped (SKIP_REGULAR_EXPRESSION), not Passed.
boost::test_tools::assertion_result cuda_present(boost::unit_test::test_unit_id) {
  if (torch::cuda::is_available()) return true;
  std::cout << "TRAINLOOP_TEST_SKIPPED: no CUDA device (this libtorch has no CUDA, or no GPU is visible)" << std::endl;
  boost::test_tools::assertion_result result(false);
  result.message() << "no CUDA device";
  return result;
}

/// This test process is rank 0 of a 1-rank torchrun-style job, so the DDP engine joins instead
/// of spawning; set before any trainloop code reads the environment.
struct OneRankJob {
  OneRankJob() {
    ::setenv("RANK", "0", 1);
    ::setenv("WORLD_SIZE", "1", 1);
    ::setenv("LOCAL_RANK", "0", 1);
    ::setenv("LOCAL_WORLD_SIZE", "1", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(distributed::find_free_port()).c_str(), 1);
  }
};
BOOST_TEST_GLOBAL_FIXTURE(OneRankJob);

/// Five SGD-momentum steps of the test MLP in `Mode` on cuda:0; the parameters afterwards, on the CPU.
template <class Mode>
torch::Tensor five_steps(Mode mode) {
  torch::manual_seed(5);
  Mlp net;
  net->to(torch::Device("cuda:0"));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto options = tl::TrainLoopOptions().batch_size(8).shuffle(false);
  tl::TrainLoop<Mlp, Mode> loop(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options, mode);
  loop.fit(tl::FitLength::iterations(5));
  return flat_params(net->parameters()).cpu();
}

}  // namespace

BOOST_AUTO_TEST_CASE(nccl_collectives_on_one_rank, *boost::unit_test::precondition(cuda_present)) {
  const torch::Device cuda("cuda:0");
  auto group = distributed::ProcessGroup::create(distributed::ProcessGroupOptions{
      .master_port = distributed::find_free_port(), .is_store_server = std::nullopt, .backend = distributed::Backend::Nccl, .device = cuda});
  BOOST_TEST((group.backend() == distributed::Backend::Nccl));
  auto x = torch::arange(6, torch::TensorOptions().dtype(torch::kFloat32).device(cuda));
  group.all_reduce_sum(x);
  BOOST_TEST(torch::equal(x.cpu(), torch::arange(6, torch::kFloat32)));
  auto cpu_tensor = torch::full({3}, 2.0);  // staged through the GPU and copied back
  group.all_reduce_max(cpu_tensor);
  BOOST_TEST(torch::equal(cpu_tensor, torch::full({3}, 2.0)));
  std::vector<torch::Tensor> several{torch::ones({4}, cuda), torch::full({2, 2}, 3, torch::TensorOptions().dtype(torch::kInt64).device(cuda))};
  group.broadcast(several, 0);
  BOOST_TEST(several[1].sum().item<int64_t>() == 12);
  group.barrier();
  // The sharded modes' collectives (ZeRO and fsdp with several ranks): reduce-scatter, all-gather
  // into a flat buffer (synchronous, and started early as full sharding's prefetch does) and the
  // all-gather of a small table; with one rank each gives its input back.
  auto flat = torch::arange(12, torch::TensorOptions().dtype(torch::kFloat32).device(cuda));
  auto share = torch::empty({12}, flat.options());
  group.reduce_scatter_sum(flat, share);
  BOOST_TEST(torch::equal(share.cpu(), torch::arange(12, torch::kFloat32)));
  auto gathered = torch::zeros({12}, flat.options());
  group.all_gather_into(share, gathered);
  BOOST_TEST(torch::equal(gathered.cpu(), torch::arange(12, torch::kFloat32)));
  auto gathered_early = torch::zeros({12}, flat.options());
  group.wait(group.all_gather_into_async(share, gathered_early), "all_gather_into_async");
  BOOST_TEST(torch::equal(gathered_early.cpu(), torch::arange(12, torch::kFloat32)));
  BOOST_TEST(torch::equal(group.all_gather(torch::ones({2, 3}, cuda)).cpu(), torch::ones({1, 2, 3})));

  // The bucketed reducer on CUDA gradients: with one rank the average is the local gradient.
  torch::manual_seed(1);
  Mlp net;
  net->to(cuda);
  distributed::GradientReducer reducer(*net, group, distributed::GradientReducerOptions{256, 1024, true});
  auto data = make_data(16, 3);
  auto batch = data.get_batch({0, 1, 2, 3, 4, 5, 6, 7});
  auto loss = torch::nn::functional::cross_entropy(net->forward(batch.data.to(cuda)), batch.target.to(cuda));
  loss.backward();
  std::vector<torch::Tensor> local;
  for (const auto& p : net->parameters()) local.push_back(p.grad().clone());
  reducer.finalize();
  BOOST_TEST(reducer.bucket_count() > 1);
  BOOST_TEST(reducer.last_launched_during_backward() > 0);
  auto params = net->parameters();
  for (size_t i = 0; i < params.size(); ++i) BOOST_TEST(torch::allclose(params[i].grad(), local[i], 0, 1e-7));
}

BOOST_AUTO_TEST_CASE(single_dp_and_ddp_give_the_same_parameters_on_cuda, *boost::unit_test::precondition(cuda_present)) {
  at::globalContext().setAllowTF32CuBLAS(false);  // exact fp32 matmuls, so 1e-5 means something
  const torch::Device cuda("cuda:0");
  auto single = five_steps(tl::gpu_mode::Single(cuda));
  auto dp = five_steps(tl::gpu_mode::DataParallel({cuda}));
  auto ddp = five_steps(tl::gpu_mode::DistributedDataParallel().device_type(torch::kCUDA).timeout(std::chrono::seconds(60)));
  BOOST_TEST_MESSAGE("max |dp - single| = " << (dp - single).abs().max().item<double>()
                                            << ", max |ddp - single| = " << (ddp - single).abs().max().item<double>());
  BOOST_TEST((dp - single).abs().max().item<double>() <= 1e-5);
  BOOST_TEST((ddp - single).abs().max().item<double>() <= 1e-5);
}

BOOST_AUTO_TEST_CASE(batches_for_cuda_are_pinned_and_pinning_changes_no_result, *boost::unit_test::precondition(cuda_present)) {
  // The loader assembles pinned batches when asked (in its worker threads too)...
  auto data = std::make_shared<tl::data::TensorDataset>(make_data(40, 1));
  for (size_t workers : {size_t{0}, size_t{2}}) {
    tl::data::BatchLoader<tl::data::TensorDataset> loader(
        data, std::vector<size_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9},
        tl::data::BatchLoaderOptions(4).num_workers(workers).pin_memory(true));
    int64_t batches = 0;
    for (auto& batch : loader) {
      BOOST_TEST(batch.data.is_pinned());
      BOOST_TEST(batch.target.is_pinned());
      ++batches;
    }
    BOOST_TEST(batches == 3);
  }
  // ...and a loop on CUDA (pin_memory on by default) trains exactly as with pageable batches.
  const torch::Device cuda("cuda:0");
  auto train = [&](bool pin) {
    torch::manual_seed(5);
    Mlp net;
    net->to(cuda);
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    tl::TrainLoop<Mlp> loop(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                            tl::TrainLoopOptions().batch_size(8).shuffle(false).num_workers(2).pin_memory(pin),
                            tl::gpu_mode::Single(cuda));
    loop.fit(tl::FitLength::iterations(5));
    return flat_params(net->parameters()).cpu();
  };
  BOOST_TEST(torch::equal(train(true), train(false)));
}

BOOST_AUTO_TEST_CASE(evaluation_on_cuda_counts_every_sample_once, *boost::unit_test::precondition(cuda_present)) {
  const torch::Device cuda("cuda:0");
  torch::manual_seed(2);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05));
  auto options = tl::TrainLoopOptions().batch_size(8).metrics({std::make_shared<tl::Accuracy>()});
  auto val = make_data(97, 2);
  tl::TrainLoop<Mlp> cpu_loop(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options);
  auto on_cpu = cpu_loop.evaluate(val);
  tl::TrainLoop<Mlp, tl::gpu_mode::DistributedDataParallel> ddp_loop(
      net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options,
      tl::gpu_mode::DistributedDataParallel().device_type(torch::kCUDA));
  auto on_cuda = ddp_loop.evaluate(val);  // NCCL sums of the sufficient statistics
  BOOST_TEST(on_cuda.samples == 97);
  BOOST_TEST(std::abs(on_cuda.loss - on_cpu.loss) <= 1e-5);
  BOOST_TEST(std::abs(on_cuda.metrics.at("accuracy") - on_cpu.metrics.at("accuracy")) <= 1e-9);
}

namespace {
/// The test MLP with dropout on CUDA: the CUDA generator's state matters for an exact resume.
struct DropoutMlpImpl : MlpImpl {
  torch::Tensor forward(torch::Tensor x) { return fc3(torch::dropout(torch::tanh(fc2(torch::tanh(fc1(x)))), 0.3, is_training())); }
};
TORCH_MODULE(DropoutMlp);
}  // namespace

BOOST_AUTO_TEST_CASE(a_cuda_checkpoint_resumes_exactly_cuda_random_stream_included, *boost::unit_test::precondition(cuda_present)) {
  at::globalContext().setAllowTF32CuBLAS(false);
  const torch::Device cuda("cuda:0");
  const auto dir = std::filesystem::temp_directory_path() / ("trainloop_cuda_ckpt_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto run = [&](uint64_t init_seed, int64_t epochs, const std::string& resume) {
    torch::manual_seed(init_seed);
    DropoutMlp net;
    net->to(cuda);
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    tl::TrainLoop<DropoutMlp> loop(net, make_data(64, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                   tl::TrainLoopOptions().batch_size(8), tl::gpu_mode::Single(cuda));
    tl::CallbackList callbacks;
    if (!resume.empty() || epochs == 2) {
      callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir)));
    }
    loop.fit(epochs, callbacks, resume);
    return flat_params(net->parameters()).cpu();
  };
  const auto uninterrupted = run(1, 4, "");
  run(1, 2, "");
  const auto resumed = run(9, 2, "last");
  const double difference = (resumed - uninterrupted).abs().max().item<double>();
  BOOST_TEST_MESSAGE("CUDA: max |resumed - uninterrupted| = " << difference);
  BOOST_TEST(difference <= 1e-6);
  std::filesystem::remove_all(dir);
}

namespace {
/// DropoutMlp that DataParallel can clone, so every replica has the dropout.
struct CloneableDropoutMlpImpl : torch::nn::Cloneable<CloneableDropoutMlpImpl> {
  CloneableDropoutMlpImpl() { reset(); }
  void reset() override {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::dropout(torch::tanh(fc1(x)), 0.3, is_training())); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(CloneableDropoutMlp);
}  // namespace

BOOST_AUTO_TEST_CASE(dp_with_dropout_on_cuda_is_reproducible_and_resumes_exactly, *boost::unit_test::precondition(cuda_present)) {
  at::globalContext().setAllowTF32CuBLAS(false);
  // Every visible device once, and cuda:0 twice more: replicas on one device share its generator.
  std::vector<torch::Device> devices;
  for (size_t i = 0; i < trainloop::detail::cuda_device_count(); ++i) devices.emplace_back(torch::kCUDA, static_cast<c10::DeviceIndex>(i));
  devices.emplace_back("cuda:0");
  const auto dir = std::filesystem::temp_directory_path() / ("trainloop_cuda_dp_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto run = [&](uint64_t init_seed, int64_t epochs, const std::string& resume) {
    torch::manual_seed(init_seed);
    CloneableDropoutMlp net;
    net->to(devices[0]);
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    tl::TrainLoop<CloneableDropoutMlp, tl::gpu_mode::DataParallel> loop(
        net, make_data(64, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(8),
        tl::gpu_mode::DataParallel(devices));
    tl::CallbackList callbacks;
    if (!resume.empty() || epochs == 2) callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir)));
    loop.fit(epochs, callbacks, resume);
    return flat_params(net->parameters()).cpu();
  };
  const auto first = run(1, 4, "");
  const auto second = run(1, 4, "");
  BOOST_TEST_MESSAGE("CUDA dp with dropout, two runs: max |difference| = " << (first - second).abs().max().item<double>());
  BOOST_TEST(torch::equal(first, second));
  run(1, 2, "");
  const auto resumed = run(9, 2, "last");
  BOOST_TEST_MESSAGE("CUDA dp with dropout: max |resumed - uninterrupted| = " << (resumed - first).abs().max().item<double>());
  BOOST_TEST(torch::equal(resumed, first));
  std::filesystem::remove_all(dir);
}

BOOST_AUTO_TEST_CASE(fp16_and_bf16_train_on_cuda_and_an_overflowing_fp16_step_is_skipped, *boost::unit_test::precondition(cuda_present)) {
  const torch::Device cuda("cuda:0");
  std::map<std::string, double> accuracy;
  for (auto precision : {tl::Precision::fp32, tl::Precision::bf16, tl::Precision::fp16}) {
    torch::manual_seed(5);
    Mlp net;
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
    tl::TrainLoop<Mlp> loop(net, make_data(800, 1), make_data(400, 2), optimizer, torch::nn::CrossEntropyLoss(),
                            tl::TrainLoopOptions().batch_size(32).precision(precision).metrics({std::make_shared<tl::Accuracy>()}),
                            tl::gpu_mode::Single(cuda));
    accuracy[tl::to_string(precision)] = loop.fit(5).last().validation->metrics.at("accuracy");
  }
  BOOST_TEST_MESSAGE("accuracy on cuda: fp32 " << accuracy["fp32"] << ", bf16 " << accuracy["bf16"] << ", fp16 " << accuracy["fp16"]);
  BOOST_TEST(std::abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.02);
  BOOST_TEST(std::abs(accuracy["fp16"] - accuracy["fp32"]) <= 0.02);

  // An inf in a gradient at step 3: that step is skipped (weights unchanged by it), the others are taken.
  struct PoisonStep3 : tl::Callback {
    torch::Tensor before;
    bool changed_at_3 = true;
    void on_batch_end(tl::TrainState& s) override {
      if (s.global_step != 2) return;  // the micro-batch of step 3 (2 steps done)
      before = flat_params(s.model->parameters()).clone();
      s.model->parameters()[0].mutable_grad().view(-1)[0] = std::numeric_limits<float>::infinity();
    }
    void on_step_end(tl::TrainState& s) override {
      if (s.global_step == 3) changed_at_3 = !torch::equal(flat_params(s.model->parameters()), before);
    }
  };
  torch::manual_seed(5);
  Mlp net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.05));
  tl::TrainLoop<Mlp> loop(net, make_data(80, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                          tl::TrainLoopOptions().batch_size(8).precision(tl::Precision::fp16), tl::gpu_mode::Single(cuda));
  auto poison = std::make_shared<PoisonStep3>();
  auto history = loop.fit(1, {poison});
  BOOST_TEST(!poison->changed_at_3);
  BOOST_TEST(history.total_steps == 10);
}

namespace {
/// Five Adam steps of the test MLP in `mode` on cuda:0 (Adam: its state is what the sharding
/// levels split); the parameters afterwards, on the CPU.
template <class Mode>
torch::Tensor five_adam_steps(Mode mode) {
  torch::manual_seed(5);
  Mlp net;
  net->to(torch::Device("cuda:0"));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop<Mlp, Mode> loop(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                tl::TrainLoopOptions().batch_size(8).shuffle(false), mode);
  loop.fit(tl::FitLength::iterations(5));
  return flat_params(net->parameters()).cpu();
}

tl::gpu_mode::DistributedDataParallel one_nccl_rank() {
  return tl::gpu_mode::DistributedDataParallel().device_type(torch::kCUDA).timeout(std::chrono::seconds(60));
}
tl::gpu_mode::FullyShardedDataParallel sharded_on_one_nccl_rank(distributed::Sharding level) {
  return tl::gpu_mode::FullyShardedDataParallel().processes_like(one_nccl_rank()).sharding(level);
}
}  // namespace

// GPU checklist item 3: every sharding level trains on CUDA through the NCCL job's code and gives
// single-device training's parameters. With one rank the sharded state keeps the whole state
// (ShardedState's one-rank state: there is nothing to split), so the levels' own collectives are
// checked in nccl_collectives_on_one_rank, and what a level saves needs several GPUs (not lent).
BOOST_AUTO_TEST_CASE(every_sharding_level_on_one_nccl_rank_equals_single_on_cuda, *boost::unit_test::precondition(cuda_present)) {
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto single = five_adam_steps(tl::gpu_mode::Single(torch::Device("cuda:0")));
  const auto plain = five_adam_steps(one_nccl_rank());
  const auto zero = five_adam_steps(one_nccl_rank().zero(true));
  const auto gradients = five_adam_steps(sharded_on_one_nccl_rank(distributed::Sharding::Gradients));
  const auto full = five_adam_steps(sharded_on_one_nccl_rank(distributed::Sharding::Full));
  for (const auto& [name, params] : std::vector<std::pair<std::string, torch::Tensor>>{
           {"ddp", plain}, {"ddp zero", zero}, {"fsdp gradients", gradients}, {"fsdp full", full}}) {
    const double difference = (params - single).abs().max().item<double>();
    BOOST_TEST_MESSAGE("NCCL 1 rank, " << name << ": max |params - single| = " << difference);
    BOOST_TEST(difference <= 1e-5, name << ": " << difference);
  }
}

namespace {
/// One backward of the test MLP on cuda:0 through a bucketed reducer over a 1-rank NCCL group with
/// `hook`: the parameters' gradients before (`local`) and after the reducer (`reduced`), and whether
/// each parameter is a matrix.
struct HookedGradients {
  std::vector<torch::Tensor> local, reduced;
  std::vector<bool> matrix;
};
HookedGradients reduce_through(std::shared_ptr<distributed::GradientCommHook> hook) {
  const torch::Device cuda("cuda:0");
  auto group = distributed::ProcessGroup::create(distributed::ProcessGroupOptions{
      .master_port = distributed::find_free_port(), .is_store_server = std::nullopt, .backend = distributed::Backend::Nccl, .device = cuda});
  torch::manual_seed(1);
  Mlp net;
  net->to(cuda);
  // The loop builds no reducer at world size 1 (the local gradient is the average); built here,
  // the hook runs its rounds of NCCL collectives on the device and completes its futures.
  distributed::GradientReducer reducer(*net, group, distributed::GradientReducerOptions{256, 1024, true});
  reducer.set_comm_hook(std::move(hook));
  auto data = make_data(16, 3);
  auto batch = data.get_batch({0, 1, 2, 3, 4, 5, 6, 7});
  torch::nn::functional::cross_entropy(net->forward(batch.data.to(cuda)), batch.target.to(cuda)).backward();
  HookedGradients out;
  for (const auto& p : net->parameters()) {
    out.local.push_back(p.grad().clone().cpu());
    out.matrix.push_back(p.dim() == 2);
  }
  reducer.finalize();
  for (const auto& p : net->parameters()) out.reduced.push_back(p.grad().cpu());
  return out;
}
}  // namespace

// The comm hooks' futures on NCCL (checklist item 3): fp16 and bf16 compress each bucket, all-reduce
// it on the device and write it back; PowerSGD all-reduces its low-rank factors there.
BOOST_AUTO_TEST_CASE(comm_hooks_run_their_futures_on_nccl, *boost::unit_test::precondition(cuda_present)) {
  // One rank: the hook's result is the local gradient rounded to its format.
  for (const auto& [name, dtype] : std::vector<std::pair<std::string, torch::Dtype>>{{"fp16", torch::kHalf}, {"bf16", torch::kBFloat16}}) {
    const auto g = reduce_through(distributed::comm_hook_named(name)());
    double difference = 0.0;
    for (size_t i = 0; i < g.local.size(); ++i)
      difference = std::max(difference, (g.reduced[i] - g.local[i].to(dtype).to(torch::kFloat32)).abs().max().item<double>());
    BOOST_TEST_MESSAGE("NCCL 1 rank, comm hook " << name << ": max |reduced - local rounded to " << name << "| = " << difference);
    BOOST_TEST(difference == 0.0, name << ": " << difference);
  }
  // PowerSGD from its first step, rank 1, every matrix compressed: a matrix's result is its
  // projection on the factor P (closer to the gradient than zero is, and not the gradient itself);
  // vectors travel whole.
  const auto g = reduce_through(std::make_shared<distributed::PowerSgdHook>(
      distributed::PowerSgdOptions().rank(1).start_iteration(0).min_compression_rate(0)));
  for (size_t i = 0; i < g.local.size(); ++i) {
    BOOST_TEST_CONTEXT("parameter " << i) {
      BOOST_TEST(torch::isfinite(g.reduced[i]).all().item<bool>());
      if (!g.matrix[i]) {
        BOOST_TEST(torch::equal(g.reduced[i], g.local[i]));
        continue;
      }
      const double error = (g.reduced[i] - g.local[i]).norm().item<double>(), size = g.local[i].norm().item<double>();
      BOOST_TEST_MESSAGE("NCCL 1 rank, PowerSGD rank 1, matrix " << i << ": |approximation - gradient| / |gradient| = " << error / size);
      BOOST_TEST(error < size);
      BOOST_TEST(error > 0.0);
    }
  }
}

namespace {
/// The test MLP trained with Adam on cuda:0 in `mode` for `epochs`, a checkpoint every 2 steps in
/// `dir`, resumed from `resume` when not empty.
template <class Mode>
torch::Tensor checkpointed_run(Mode mode, const std::filesystem::path& dir, int64_t epochs, const std::string& resume,
                               uint64_t init_seed = 1) {
  torch::manual_seed(init_seed);
  Mlp net;
  net->to(torch::Device("cuda:0"));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));
  tl::TrainLoop<Mlp, Mode> loop(net, make_data(64, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                                tl::TrainLoopOptions().batch_size(8), mode);
  loop.fit(epochs, {std::make_shared<tl::ModelCheckpoint>(tl::ModelCheckpointOptions(dir).every_n_steps(2))}, resume);
  return flat_params(net->parameters()).cpu();
}
}  // namespace

// A sharded run's checkpoint on CUDA under NCCL resumes exactly. One rank holds the whole state, so
// it writes the gathered checkpoint (per-rank checkpoints, DCP's layout, need 2 ranks: 2 GPUs): the
// shares gathered from the device, the optimizer state laid out again on resume.
BOOST_AUTO_TEST_CASE(a_sharded_run_on_one_nccl_rank_resumes_its_cuda_checkpoint_exactly, *boost::unit_test::precondition(cuda_present)) {
  at::globalContext().setAllowTF32CuBLAS(false);
  const auto root = std::filesystem::temp_directory_path() / ("trainloop_cuda_sharded_" + std::to_string(::getpid()));
  auto check = [&](auto mode, const std::string& name) {
    BOOST_TEST_CONTEXT(name) {
      std::filesystem::remove_all(root);
      const torch::Tensor uninterrupted = checkpointed_run(mode, root / "uninterrupted", 4, "");
      checkpointed_run(mode, root / "resumed", 2, "");
      BOOST_TEST(std::filesystem::exists(root / "resumed" / "last.ckpt"));
      const torch::Tensor resumed = checkpointed_run(mode, root / "resumed", 2, "last", 9);
      const double difference = (resumed - uninterrupted).abs().max().item<double>();
      BOOST_TEST_MESSAGE("CUDA checkpoint, " << name << ": max |resumed - uninterrupted| = " << difference);
      BOOST_TEST(difference <= 1e-6);
    }
  };
  check(one_nccl_rank().zero(true), "ddp zero (sharding optimizer)");
  check(sharded_on_one_nccl_rank(distributed::Sharding::Full), "fsdp full");
  std::filesystem::remove_all(root);
}

namespace {
/// Every parameter and buffer of `net` on the device it lives on (the loaders copy into the
/// model's own tensors: a CUDA model stays on CUDA).
bool all_on(Mlp& net, const torch::Device& device) {
  for (const auto& t : net->parameters()) if (t.device() != device) return false;
  for (const auto& t : net->buffers()) if (t.device() != device) return false;
  return true;
}
}  // namespace

// Weight files and a CUDA model (not run on a GPU before 2026-11-30): safetensors (one file and
// Hugging Face's sharded form) and DCP written from a CPU model load into a model on cuda:0 bit
// for bit, that model trains a step there, and what it writes from the device reads back on the
// CPU bit for bit.
BOOST_AUTO_TEST_CASE(weight_files_load_into_and_are_written_from_a_cuda_model, *boost::unit_test::precondition(cuda_present)) {
  const torch::Device cuda("cuda:0"), cpu(torch::kCPU);
  const auto root = std::filesystem::temp_directory_path() / ("trainloop_cuda_weights_" + std::to_string(::getpid()));
  std::filesystem::remove_all(root);
  std::filesystem::create_directories(root);
  torch::manual_seed(1);
  Mlp source(16, true);
  source->bn->running_mean.uniform_();  // buffers that differ from a fresh model's
  source->bn->num_batches_tracked.fill_(7);
  using Save = std::function<void(const Mlp&, const std::filesystem::path&)>;
  using Load = std::function<void(Mlp&, const std::filesystem::path&)>;
  const std::vector<std::tuple<std::string, std::string, Save, Load>> formats{
      {"safetensors", "w.safetensors", [](const Mlp& m, const auto& p) { tl::interop::save_safetensors(*m, p); },
       [](Mlp& m, const auto& p) { BOOST_TEST(tl::interop::load_safetensors(*m, p).complete()); }},
      {"sharded safetensors", "hf/", [](const Mlp& m, const auto& p) { tl::interop::save_safetensors(*m, p, {.max_shard_bytes = 512}); },
       [](Mlp& m, const auto& p) { BOOST_TEST(tl::interop::load_safetensors(*m, p).complete()); }},
      {"dcp", "dcp", [](const Mlp& m, const auto& p) { tl::interop::save_dcp_weights(*m, p); },
       [](Mlp& m, const auto& p) { tl::interop::load_dcp_weights(*m, p); }}};
  for (const auto& [name, file, save, load] : formats) {
    BOOST_TEST_CONTEXT(name) {
      save(source, root / ("from_cpu_" + file));
      torch::manual_seed(2);
      Mlp on_cuda(16, true);
      on_cuda->to(cuda);
      load(on_cuda, root / ("from_cpu_" + file));
      BOOST_TEST(all_on(on_cuda, cuda));
      BOOST_TEST(torch::equal(flat_state(*on_cuda).cpu(), flat_state(*source)));
      // It trains there: one SGD step moves the weights, and the file is written from the device.
      torch::optim::SGD optimizer(on_cuda->parameters(), torch::optim::SGDOptions(0.1));
      auto batch = make_data(8, 3).get_batch({0, 1, 2, 3, 4, 5, 6, 7});
      torch::nn::functional::cross_entropy(on_cuda->forward(batch.data.to(cuda)), batch.target.to(cuda)).backward();
      optimizer.step();
      BOOST_TEST(!torch::equal(flat_state(*on_cuda).cpu(), flat_state(*source)));
      save(on_cuda, root / ("from_cuda_" + file));
      torch::manual_seed(3);
      Mlp back_on_cpu(16, true);
      load(back_on_cpu, root / ("from_cuda_" + file));
      BOOST_TEST(all_on(back_on_cpu, cpu));
      BOOST_TEST(torch::equal(flat_state(*back_on_cpu), flat_state(*on_cuda).cpu()));
    }
  }
  std::filesystem::remove_all(root);
}
