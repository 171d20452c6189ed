#define BOOST_TEST_MODULE test_memory_format
#include "unit_test.hpp"

// Channels-last (nn/memory_format.hpp): what the automatic rule chooses, that the model and its
// inputs really are in that layout, that results equal contiguous training, and that
// checkpoints are written contiguous and resume in either format.

#include "test_support.hpp"

#include <trainloop/trainloop.hpp>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace tl = trainloop;

namespace {

/// 8x8 RGB images of 3 classes (which quadrant is brightest, more or less). Three channels: with
/// one, NCHW and NHWC are the same layout and nothing would be converted.
tl::data::TensorDataset images(int64_t n, uint64_t seed) {
  auto generator = at::detail::createCPUGenerator(seed);
  auto x = torch::randn({n, 3, 8, 8}, generator);
  auto y = torch::stack({x.narrow(2, 0, 4).sum({1, 2, 3}), x.narrow(2, 4, 4).narrow(3, 0, 4).sum({1, 2, 3}),
                         x.narrow(2, 4, 4).narrow(3, 4, 4).sum({1, 2, 3})}, 1).argmax(1);
  return tl::data::TensorDataset(x, y, 3);
}

/// Conv (no bias: BatchNorm follows) -> BatchNorm2d -> ReLU -> Conv -> pooled linear head; counts the channels-last inputs it sees.
struct ConvNetImpl : torch::nn::Cloneable<ConvNetImpl> {
  ConvNetImpl() { reset(); }
  void reset() override {
    torch::manual_seed(3);
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 6, 3).padding(1).bias(false)));
    bn = register_module("bn", torch::nn::BatchNorm2d(6));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8, 3));
  }
  torch::Tensor forward(torch::Tensor x) {
    if (x.is_contiguous(torch::MemoryFormat::ChannelsLast) && !x.is_contiguous()) ++channels_last_inputs;
    x = torch::relu(conv2(torch::relu(bn(conv1(x)))));
    return fc(x.mean({2, 3}));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::BatchNorm2d bn{nullptr};
  torch::nn::Linear fc{nullptr};
  static inline std::atomic<int> channels_last_inputs{0};
};
TORCH_MODULE(ConvNet);

torch::Tensor flat(const torch::nn::Module& net) {
  std::vector<torch::Tensor> all;
  for (const auto& t : net.parameters()) all.push_back(t.detach().reshape({-1}));
  for (const auto& t : net.buffers()) all.push_back(t.detach().reshape({-1}).to(torch::kFloat64).to(torch::kFloat32));
  return torch::cat(all);
}

bool channels_last(const ConvNet& net) {
  const auto& weight = net->conv2->weight;
  return weight.is_contiguous(torch::MemoryFormat::ChannelsLast) && !weight.is_contiguous();
}

tl::TrainLoopOptions options(tl::MemoryFormat format) {
  return tl::TrainLoopOptions().batch_size(16).seed(5).memory_format(format).progress(false);
}

/// SGD with momentum: Adam would turn rounding noise in near-zero gradients into whole steps.
torch::optim::SGD sgd(ConvNet& net) {
  return torch::optim::SGD(net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
}

/// Trains 5 steps (80 samples, batch 16) in `Mode`; returns the parameters and buffers.
template <class Mode = tl::gpu_mode::Single>
torch::Tensor five_steps(tl::MemoryFormat format, Mode mode = {}) {
  ConvNet net;
  auto optimizer = sgd(net);
  tl::TrainLoop<ConvNet, Mode> loop(net, images(80, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options(format),
                                    mode);
  loop.fit(1);
  BOOST_TEST(loop.history().last().samples == 80);
  BOOST_TEST(channels_last(net) == (format != tl::MemoryFormat::contiguous));
  return flat(*net);
}

}  // namespace

BOOST_AUTO_TEST_CASE(the_automatic_rule_chooses_channels_last_for_2d_convolutions_only) {
  ConvNet conv;
  torch::nn::Sequential mlp(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  torch::nn::Conv1d conv1d(torch::nn::Conv1dOptions(2, 4, 3));
  torch::nn::Conv3d conv3d(torch::nn::Conv3dOptions(2, 4, 3));
  BOOST_TEST(tl::nn::uses_channels_last(tl::MemoryFormat::automatic, *conv));
  BOOST_TEST(!tl::nn::uses_channels_last(tl::MemoryFormat::automatic, *mlp));
  BOOST_TEST(!tl::nn::uses_channels_last(tl::MemoryFormat::automatic, *conv1d));
  BOOST_TEST(!tl::nn::uses_channels_last(tl::MemoryFormat::automatic, *conv3d));
  BOOST_TEST(!tl::nn::uses_channels_last(tl::MemoryFormat::contiguous, *conv));
  BOOST_TEST(tl::nn::uses_channels_last(tl::MemoryFormat::channels_last, *conv));
  BOOST_TEST(tl::TrainLoopOptions().memory_format() == tl::MemoryFormat::automatic);
  BOOST_TEST(tl::parse_memory_format("channels-last") == tl::MemoryFormat::channels_last);
  BOOST_TEST(tl::parse_memory_format("channels_last") == tl::MemoryFormat::channels_last);
  BOOST_TEST(tl::parse_memory_format("auto") == tl::MemoryFormat::automatic);
  BOOST_TEST(tl::to_string(tl::MemoryFormat::channels_last) == "channels-last");
  BOOST_TEST(error_of([] { tl::parse_memory_format("nhwc"); }) ==
             "trainloop: memory format is 'nhwc'; expected auto, contiguous or channels-last");

  // An MLP trained with the default stays as it was (its 2-d weights have no channels).
  torch::optim::SGD optimizer(mlp->parameters(), torch::optim::SGDOptions(0.1));
  const auto before = mlp->parameters()[0].strides().vec();
  tl::TrainLoop<torch::nn::Sequential> loop(mlp, tl::data::TensorDataset(torch::randn({8, 4}), torch::zeros({8}, torch::kLong)),
                                            {}, optimizer, torch::nn::CrossEntropyLoss(), options(tl::MemoryFormat::automatic));
  loop.fit(1);
  BOOST_TEST(mlp->parameters()[0].strides().vec() == before);
}

BOOST_AUTO_TEST_CASE(channels_last_training_equals_contiguous_training_and_feeds_channels_last_inputs) {
  ConvNetImpl::channels_last_inputs = 0;
  const torch::Tensor contiguous = five_steps(tl::MemoryFormat::contiguous);
  BOOST_TEST(ConvNetImpl::channels_last_inputs.load() == 0);
  const torch::Tensor automatic = five_steps(tl::MemoryFormat::automatic);
  BOOST_TEST(ConvNetImpl::channels_last_inputs.load() == 5);  // every training batch
  const double difference = (contiguous - automatic).abs().max().item<double>();
  BOOST_TEST_MESSAGE("max |contiguous - channels-last| after 5 SGD steps: " << difference);
  BOOST_TEST(difference < 1e-5);
  BOOST_TEST((contiguous - five_steps(tl::MemoryFormat::channels_last)).abs().max().item<double>() < 1e-5);
  // DataParallel's replicas are cloned from the converted model and train the same (compared
  // with dp contiguous: each replica's BatchNorm normalises its half of the batch).
  const auto two_replicas = tl::gpu_mode::DataParallel::cpu_replicas(2);
  ConvNetImpl::channels_last_inputs = 0;
  const torch::Tensor dp_contiguous = five_steps(tl::MemoryFormat::contiguous, two_replicas);
  BOOST_TEST(ConvNetImpl::channels_last_inputs.load() == 0);
  const torch::Tensor dp = five_steps(tl::MemoryFormat::automatic, two_replicas);
  BOOST_TEST(ConvNetImpl::channels_last_inputs.load() == 10);  // both replicas, every batch
  BOOST_TEST_MESSAGE("max |dp contiguous - dp channels-last| after 5 SGD steps: "
                     << (dp_contiguous - dp).abs().max().item<double>());
  BOOST_TEST((dp_contiguous - dp).abs().max().item<double>() < 1e-5);
}

BOOST_AUTO_TEST_CASE(evaluate_and_predict_give_the_same_numbers_in_both_formats) {
  ConvNet net;
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<ConvNet> contiguous(net, images(40, 2), images(24, 3), optimizer, torch::nn::CrossEntropyLoss(),
                                    options(tl::MemoryFormat::contiguous));
  const auto eval_contiguous = contiguous.evaluate(images(24, 3));
  const torch::Tensor predicted_contiguous = contiguous.predict(images(24, 3));
  BOOST_TEST(!channels_last(net));
  ConvNetImpl::channels_last_inputs = 0;
  tl::TrainLoop<ConvNet> converted(net, images(40, 2), images(24, 3), optimizer, torch::nn::CrossEntropyLoss(),
                                   options(tl::MemoryFormat::channels_last));
  const auto eval_converted = converted.evaluate(images(24, 3));
  const torch::Tensor predicted_converted = converted.predict(images(24, 3));
  BOOST_TEST(channels_last(net));
  BOOST_TEST(ConvNetImpl::channels_last_inputs.load() >= 2);
  BOOST_TEST(std::abs(eval_contiguous.loss - eval_converted.loss) < 1e-5);
  BOOST_TEST((predicted_contiguous - predicted_converted).abs().max().item<double>() < 1e-5);
}

BOOST_AUTO_TEST_CASE(checkpoints_are_written_contiguous_and_resume_in_either_format) {
  TempDir dir("tl-memory-format");
  // Uninterrupted reference: 2 epochs in channels-last.
  auto run = [&](tl::MemoryFormat format, int64_t epochs, const std::string& resume, bool save) {
    ConvNet net;
    auto optimizer = sgd(net);
    tl::TrainLoop<ConvNet> loop(net, images(80, 1), {}, optimizer, torch::nn::CrossEntropyLoss(), options(format));
    if (save) {
      loop.fit(epochs, {tl::ModelCheckpoint(tl::ModelCheckpointOptions(dir.path))});
    } else {
      loop.fit(epochs, {}, resume);
    }
    BOOST_TEST(channels_last(net) == (format != tl::MemoryFormat::contiguous));
    return flat(*net);
  };
  const torch::Tensor uninterrupted = run(tl::MemoryFormat::channels_last, 2, {}, false);
  run(tl::MemoryFormat::channels_last, 1, {}, true);
  const auto file = tl::checkpoint_candidates(dir.path).front();

  // The file holds the weights contiguous: a plain torch::load gives a default-layout model.
  ConvNet plain;
  torch::load(plain, file.string());
  BOOST_TEST(plain->conv1->weight.is_contiguous());
  BOOST_TEST(plain->conv2->weight.is_contiguous());

  // Resumed for the second epoch in channels-last (as written) and in contiguous memory.
  const torch::Tensor same_format = run(tl::MemoryFormat::channels_last, 1, file.string(), false);
  const torch::Tensor other_format = run(tl::MemoryFormat::contiguous, 1, file.string(), false);
  BOOST_TEST(torch::equal(same_format, uninterrupted));  // bit for bit, as every resume
  BOOST_TEST_MESSAGE("max |uninterrupted - resumed contiguous|: " << (other_format - uninterrupted).abs().max().item<double>());
  BOOST_TEST((other_format - uninterrupted).abs().max().item<double>() < 1e-5);
}

// bf16 on the CPU: the hardware check behind the one warning (precision/native_bf16.hpp).
BOOST_AUTO_TEST_CASE(bf16_hardware_is_read_from_the_cpu_flags_and_the_onednn_isa_cap) {
  BOOST_TEST(tl::detail::cpuinfo_has_bf16("processor : 0\nflags : fpu avx512f amx_bf16 amx_tile\n"));
  BOOST_TEST(tl::detail::cpuinfo_has_bf16("flags\t\t: fpu avx512f avx512_bf16\n"));
  BOOST_TEST(!tl::detail::cpuinfo_has_bf16("flags : fpu avx2 avx512f avx512bw\n"));  // AVX-512 without BF16
  BOOST_TEST(!tl::detail::cpuinfo_has_bf16("model name : no flags line\n"));
  // The reader behind it (detail/cpuinfo.hpp), also used by the benchmarks for the model name and clock.
  const std::string sample = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480C \ncpu MHz\t\t: 2100.000\n"
                              "flags\t\t: fpu fma avx2\nprocessor\t: 1\nmodel name\t: other\n";
  BOOST_TEST(tl::detail::cpuinfo_value(sample, "model name") == "Intel(R) Xeon(R) Platinum 8480C");  // the first processor's
  BOOST_TEST(tl::detail::cpuinfo_value(sample, "cpu MHz") == "2100.000");
  BOOST_TEST(tl::detail::cpuinfo_value(sample, "bogomips").empty());
  BOOST_TEST(tl::detail::cpuinfo_has_flag(sample, "fma"));
  BOOST_TEST(!tl::detail::cpuinfo_has_flag(sample, "fm"));  // whole words only
  BOOST_TEST(tl::detail::isa_cap_allows_bf16("avx512_core_amx"));
  BOOST_TEST(tl::detail::isa_cap_allows_bf16("ALL"));
  BOOST_TEST(!tl::detail::isa_cap_allows_bf16("AVX512_CORE"));
  BOOST_TEST(!tl::detail::isa_cap_allows_bf16("AVX2"));
  // This machine: capping oneDNN below bf16 makes it a CPU without native bf16, and fit() says so
  // once; fp32 or a CUDA device never warns.
  ::setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE", 1);
  BOOST_TEST(!tl::cpu_has_native_bf16());
  BOOST_TEST(!tl::warn_if_bf16_is_emulated(tl::Precision::fp32, torch::kCPU));
  BOOST_TEST(tl::warn_if_bf16_is_emulated(tl::Precision::bf16, torch::kCPU));
  BOOST_TEST(!tl::warn_if_bf16_is_emulated(tl::Precision::bf16, torch::kCPU));  // once
  ::unsetenv("ONEDNN_MAX_CPU_ISA");
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::ostringstream text;
  text << cpuinfo.rdbuf();
  BOOST_TEST(tl::cpu_has_native_bf16() == tl::detail::cpuinfo_has_bf16(text.str()));
  BOOST_TEST_MESSAGE("this CPU runs bf16 natively: " << std::boolalpha << tl::cpu_has_native_bf16());
}
