// ddp_step_instructions: what trainloop itself costs per DDP step and per fit() on one rank,
// in instructions (callgrind), so that a change to the loop's collectives and bookkeeping can be
// compared before/after on a noisy machine. Run by benchmarks/run_ddp_step_instructions.sh, which
// starts the ranks itself (torchrun's variables: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) under
//
//   OMP_NUM_THREADS=1 valgrind --tool=callgrind --instr-atstart=no ...
//
// The model is tiny on purpose (an MLP 16 -> 8 -> 4, batch 4 per rank): the kernels cost little,
// so the counts are dominated by what the loop, the gradient reducer and the collectives do.
// A warm-up fit (connections, allocator) runs uninstrumented; then one fit of `--short-steps`
// and one of `--long-steps` run instrumented, each dumped on its own
// (CALLGRIND_DUMP_STATS_AT "fit_short" / "fit_long"). Their difference divided by the step
// difference is the cost of a step; the short fit minus its steps is the cost of a fit.
// Only public API, so the same file builds against older trainloop commits.

#include <trainloop/gpu_mode/distributed_data_parallel.hpp>
#include <trainloop/trainloop.hpp>

#include <CLI/CLI.hpp>

#include <cstdio>
#include <iostream>

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#define STEP_COUNT_BEGIN() CALLGRIND_START_INSTRUMENTATION
#define STEP_COUNT_END(name) \
  do {                       \
    CALLGRIND_STOP_INSTRUMENTATION; \
    CALLGRIND_DUMP_STATS_AT(name);  \
  } while (false)
#else
#define STEP_COUNT_BEGIN() ((void)0)
#define STEP_COUNT_END(name) ((void)0)
#endif

namespace tl = trainloop;

namespace {

struct TinyMlpImpl : torch::nn::Module {
  TinyMlpImpl() : fc1(register_module("fc1", torch::nn::Linear(16, 8))), fc2(register_module("fc2", torch::nn::Linear(8, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(TinyMlp);

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"trainloop's instructions per DDP step and per fit (run under callgrind by run_ddp_step_instructions.sh)"};
  int64_t short_steps = 4, long_steps = 12, batch_size = 4;
  app.add_option("--short-steps", short_steps, "optimizer steps of the first instrumented fit")->check(CLI::PositiveNumber);
  app.add_option("--long-steps", long_steps, "optimizer steps of the second instrumented fit")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", batch_size, "per-rank batch size")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::manual_seed(0);
    const int64_t samples = 2 * batch_size * (long_steps + short_steps + 2);
    auto x = torch::randn({samples, 16}, at::detail::createCPUGenerator(1));
    auto y = torch::randint(0, 4, {samples}, at::detail::createCPUGenerator(2));
    tl::data::TensorDataset train(x, y, 4);
    TinyMlp net;
    torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.01).momentum(0.9));
    auto mode = tl::gpu_mode::DistributedDataParallel().device_type(torch::kCPU);
    auto options = tl::TrainLoopOptions().batch_size(batch_size).shuffle(false).metrics({})
                       .memory_format(tl::MemoryFormat::contiguous);
    tl::TrainLoop<TinyMlp, tl::gpu_mode::DistributedDataParallel> loop(net, train, {}, optimizer,
                                                                       torch::nn::CrossEntropyLoss(), options, mode);
    loop.fit(tl::FitLength::iterations(2));  // warm-up: the process group, Gloo's pairs, the allocator
    STEP_COUNT_BEGIN();
    loop.fit(tl::FitLength::iterations(short_steps));
    STEP_COUNT_END("fit_short");
    STEP_COUNT_BEGIN();
    auto history = loop.fit(tl::FitLength::iterations(long_steps));
    STEP_COUNT_END("fit_long");
    std::printf("RESULT steps %lld loss %.6f\n", static_cast<long long>(history.total_steps),
                history.epochs.empty() ? 0.0 : history.epochs.back().train_loss);
  } catch (const std::exception& e) {
    std::cerr << "ddp_step_instructions: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
