// checkpoint_io: what a checkpoint costs. Two measurements:
//
// 1. write: the time and size of one checkpoint (model + Adam state + progress + random streams,
//    written atomically with fsync) of the example CNN (~420k parameters) or of a ~100 MB MLP
//    (784 -> 4608 -> 4608 -> 10, 24.9 M parameters), after one Adam step so the optimizer state
//    is complete. benchmarks/checkpoint_pytorch.py does the same with Python's torch.save (and an
//    fsync, for the same durability); benchmarks/run_checkpoint_io.sh alternates the two.
//
//      checkpoint_io --measure write --model cnn --repetitions 3 --dir /tmp
//
// 2. cost: training throughput of the example CNN on synthetic images with a ModelCheckpoint
//    every N steps against none, alternated repetition by repetition; prints the median ratio.
//
//      checkpoint_io --measure cost --every-steps 50 --steps 200 --repetitions 3 --dir /tmp
//
// 3. distcp: one rank's DCP data file (`__<rank>_0.distcp`, as a per-rank checkpoint and elastic
//    training's hand-off write them) of --megabytes of float32 boxes that are views into one block
//    (as a rank's captured shares are), written by DCP's writer (each box streamed from its memory)
//    against libtorch's torch::jit::pickle_save of a contiguous copy of each box written out (the
//    writer's way until 2026-12-01), alternated, fsynced, into --dir.
//
//      checkpoint_io --measure distcp --megabytes 400 --repetitions 7 --dir /dev/shm
//
// Output: one line per repetition, then `RESULT trainloop ...` lines with medians.
// Exit status: 0 whatever the numbers; 1 on errors.

#include "bench_common.hpp"
#include "fashion_net.hpp"

#include <trainloop/detail/atomic_file.hpp>
#include <trainloop/serialization/dcp/distcp_writer.hpp>
#include <trainloop/trainloop.hpp>

#include <torch/csrc/jit/serialization/pickle.h>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace {

namespace tl = trainloop;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Config {
  std::string measure = "write";
  std::string model = "cnn";
  int64_t repetitions = 3;
  int64_t every_steps = 50;
  int64_t steps = 200;
  int64_t batch_size = 64;
  int64_t megabytes = 400;
  std::string dir = fs::temp_directory_path().string();
};

/// Random images of Fashion-MNIST's shape: the checkpoint's content does not depend on the data.
tl::data::TensorDataset synthetic_images(int64_t n) {
  auto x = torch::randn({n, 1, 28, 28}, at::detail::createCPUGenerator(1));
  auto y = torch::randint(0, 10, {n}, at::detail::createCPUGenerator(2));
  return tl::data::TensorDataset(x, y, 10);
}

template <class Model>
int write_benchmark(const Config& c, tl::data::AnyDataset<> data, const char* name) {
  torch::manual_seed(0);
  Model net;
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-3));
  tl::TrainLoop<Model> loop(net, std::move(data), {}, optimizer, torch::nn::CrossEntropyLoss(),
                            tl::TrainLoopOptions().batch_size(c.batch_size));
  loop.fit(tl::FitLength::iterations(1));  // Adam's moments exist from here on
  int64_t parameters = 0;
  for (const auto& p : net->parameters()) parameters += p.numel();
  const fs::path path = fs::path(c.dir) / (std::string("checkpoint_io_") + name + ".ckpt");
  std::vector<double> seconds;
  for (int64_t r = 0; r < c.repetitions; ++r) {
    const auto start = Clock::now();
    loop.save_checkpoint(path);
    seconds.push_back(std::chrono::duration<double>(Clock::now() - start).count());
    std::printf("rep %lld: %s checkpoint %.3f s, %.1f MB\n", static_cast<long long>(r + 1), name, seconds.back(),
                static_cast<double>(fs::file_size(path)) / 1e6);
  }
  std::printf("RESULT trainloop model %s parameters %lld seconds %.4f bytes %lld\n", name,
              static_cast<long long>(parameters), bench::median(seconds), static_cast<long long>(fs::file_size(path)));
  fs::remove(path);
  return 0;
}

int cost_benchmark(const Config& c) {
  const auto data = synthetic_images(c.steps * c.batch_size);
  const fs::path dir = fs::path(c.dir) / "checkpoint_io_cost";
  auto pass = [&](bool with_checkpoints) {
    torch::manual_seed(0);
    FashionNet net;
    torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-3));
    tl::TrainLoop<FashionNet> loop(net, data, {}, optimizer, torch::nn::CrossEntropyLoss(),
                                   tl::TrainLoopOptions().batch_size(c.batch_size).shuffle(false));
    tl::CallbackList callbacks;
    if (with_checkpoints) {
      fs::remove_all(dir);
      callbacks.push_back(std::make_shared<tl::ModelCheckpoint>(
          tl::ModelCheckpointOptions(dir).every_n_epochs(0).every_n_steps(c.every_steps).keep_last(1)));
    }
    const auto history = loop.fit(1, callbacks);
    return history.last().samples_per_second;
  };
  pass(false);  // warm-up
  std::vector<double> ratios, with, without;
  for (int64_t r = 0; r < c.repetitions; ++r) {
    double a = 0, b = 0;
    if (r % 2 == 0) {
      a = pass(false);
      b = pass(true);
    } else {
      b = pass(true);
      a = pass(false);
    }
    without.push_back(a);
    with.push_back(b);
    ratios.push_back(b / a);
    std::printf("rep %lld: without %.1f samples/s, checkpoint every %lld steps %.1f samples/s, ratio %.4f\n",
                static_cast<long long>(r + 1), a, static_cast<long long>(c.every_steps), b, b / a);
  }
  std::printf("RESULT trainloop cost every_steps %lld steps %lld without %.1f with %.1f median_ratio %.4f "
              "(min %.4f, max %.4f)\n",
              static_cast<long long>(c.every_steps), static_cast<long long>(c.steps), bench::median(without),
              bench::median(with), bench::median(ratios), *std::min_element(ratios.begin(), ratios.end()),
              *std::max_element(ratios.begin(), ratios.end()));
  fs::remove_all(dir);
  return 0;
}

int distcp_benchmark(const Config& c) {
  const int64_t boxes = 6, floats = std::max<int64_t>(1, c.megabytes * 1000000 / 4 / boxes);
  const torch::Tensor block = torch::rand({boxes * floats + 16}, at::detail::createCPUGenerator(3));
  std::vector<torch::Tensor> views;  // 16 floats in: no box starts where the block does
  for (int64_t i = 0; i < boxes; ++i) views.push_back(block.narrow(0, 16 + i * floats, floats));
  const fs::path dir = fs::path(c.dir) / "checkpoint_io_distcp";
  fs::create_directories(dir);
  auto streamed = [&] {
    tl::serialization::dcp::DistcpWriter writer(dir, 0);
    for (int64_t i = 0; i < boxes; ++i) writer.add_tensor_chunk("box" + std::to_string(i), views[static_cast<size_t>(i)], {0}, {floats});
    (void)writer.finish();
  };
  auto copied = [&] {
    tl::detail::BasicAtomicFile<tl::CheckpointError> file(dir / "__1_0.distcp", "the copied way's file");
    for (const torch::Tensor& view : views) {
      const torch::Tensor copy = view.clone();
      const std::vector<char> saved = torch::jit::pickle_save(copy);
      file.write(std::string_view(saved.data(), saved.size()));
    }
    file.commit();
  };
  auto seconds_of = [](const auto& write) {
    const auto start = Clock::now();
    write();
    return std::chrono::duration<double>(Clock::now() - start).count();
  };
  std::vector<double> with_stream, with_copies;
  for (int64_t r = 0; r < c.repetitions; ++r) {
    const bool stream_first = r % 2 == 0;
    const double first = seconds_of([&] { stream_first ? streamed() : copied(); });
    const double second = seconds_of([&] { stream_first ? copied() : streamed(); });
    with_stream.push_back(stream_first ? first : second);
    with_copies.push_back(stream_first ? second : first);
    std::printf("rep %lld: streamed %.3f s, pickle_save of copies %.3f s\n", static_cast<long long>(r + 1),
                with_stream.back(), with_copies.back());
  }
  const auto [stream_min, stream_max] = std::minmax_element(with_stream.begin(), with_stream.end());
  const auto [copies_min, copies_max] = std::minmax_element(with_copies.begin(), with_copies.end());
  std::printf("RESULT trainloop distcp bytes %lld streamed %.4f (%.4f-%.4f) pickle_save_of_copies %.4f (%.4f-%.4f)\n",
              static_cast<long long>(boxes * floats * 4), bench::median(with_stream), *stream_min, *stream_max,
              bench::median(with_copies), *copies_min, *copies_max);
  fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Checkpoint write time, size, and throughput cost"};
  Config c;
  app.add_option("--measure", c.measure,
                 "write (time and size of one checkpoint), cost (throughput with checkpoints) or distcp (a rank's DCP "
                 "data file: streamed against pickle_save of copies)")
      ->check(CLI::IsMember({"write", "cost", "distcp"}));
  app.add_option("--megabytes", c.megabytes, "distcp: the boxes' size")->check(CLI::PositiveNumber);
  app.add_option("--model", c.model, "write: cnn (the example's) or mlp100 (~100 MB of parameters)")
      ->check(CLI::IsMember({"cnn", "mlp100"}));
  app.add_option("--repetitions", c.repetitions, "repetitions")->check(CLI::PositiveNumber);
  app.add_option("--every-steps", c.every_steps, "cost: a checkpoint every N optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--steps", c.steps, "cost: optimizer steps per pass")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", c.batch_size, "samples per batch")->check(CLI::PositiveNumber);
  app.add_option("--dir", c.dir, "where the checkpoints are written");
  CLI11_PARSE(app, argc, argv);
  try {
    if (c.measure == "cost") return cost_benchmark(c);
    if (c.measure == "distcp") return distcp_benchmark(c);
    if (c.model == "mlp100") {
      bench::mlp_shape() = bench::MlpShape{4608, 2};
      const auto mlp_data = bench::synthetic_mlp_data(c.batch_size, 0, torch::kCPU);
      return write_benchmark<bench::WideMlp>(c, tl::data::TensorDataset(mlp_data.inputs, mlp_data.targets, 10), "mlp100");
    }
    return write_benchmark<FashionNet>(c, synthetic_images(c.batch_size), "cnn");
  } catch (const std::exception& e) {
    std::cerr << "checkpoint_io: " << e.what() << '\n';
    return 1;
  }
}
