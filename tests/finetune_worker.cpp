// A program that fine-tunes with gpu_mode::DistributedDataParallel, driven by test_finetune:
// fit() re-executes it once per rank, as it does a user's program, so every rank runs the same
// freeze and unfreeze calls.
//
//   finetune_worker <scenario> <world> <out-dir>
//
// Scenarios: those of run_finetune_scenario (finetune_test_model.hpp), with batches of 4 per
// rank, and zoo_resnet18_<float64|float32>_<data seed> (run_zoo_resnet18_fine_tune). Writes <out-dir>/state.pt (the model's parameters and buffers after training, as the
// caller's model holds them). Exit status 0, or 3 after printing the error.

#include "finetune_test_model.hpp"

#include <chrono>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>

int main(int argc, char** argv) {
  if (argc < 4) {
    std::cerr << "usage: finetune_worker <scenario> <world> <out-dir>\n";
    return 2;
  }
  const std::string scenario = argv[1], dir = argv[3];
  const int world = std::atoi(argv[2]);
  try {
    const auto mode = trainloop::gpu_mode::DistributedDataParallel()
                          .procs_per_node(world)
                          .device_type(torch::kCPU)
                          .timeout(std::chrono::seconds(60));
    if (scenario.rfind("zoo_resnet18_", 0) == 0) {  // zoo_resnet18_<float64|float32>_<data seed>
      const bool f64 = scenario.find("float64") != std::string::npos;
      const auto seed = std::stoull(scenario.substr(scenario.rfind('_') + 1));
      torch::save(run_zoo_resnet18_fine_tune(mode, 4, f64 ? torch::kFloat64 : torch::kFloat32, seed), dir + "/state.pt");
      return 0;
    }
    const auto run = run_finetune_scenario(scenario, mode, 4, /*batch_norm=*/true);
    torch::save(run.state, dir + "/state.pt");
  } catch (const std::exception& error) {
    std::cerr << "finetune_worker: " << error.what() << "\n";
    return 3;
  }
  return 0;
}
