#define BOOST_TEST_MODULE test_sharding
#include "unit_test.hpp"

#include "test_paths.hpp"

// Sharding over DDP's ranks: ZeRO-1 (DistributedDataParallel().zero(true), sharding optimizer), and
// FullyShardedDataParallel's levels gradients and full. Who owns what, how units and bad settings
// are named, each level against plain DDP (parameters, Adam's moments, the state each rank holds),
// and each level's restarts and checkpoints in any mode and world size.

#include "ddp_test_support.hpp"

#include <stdio.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

// ---- ZeRO-1: the optimizer state sharded over the ranks (distributed/zero/zero_optimizer_shard.hpp) ----

BOOST_AUTO_TEST_CASE(zero_owners_balance_the_elements_and_bad_settings_are_named) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  for (int world : {2, 3, 4}) {
    int64_t total = 0, most = 0, least = kMlpParameters;
    const auto layout = std::make_shared<const tl::distributed::FlatLayout>(adam, world);
    for (int r = 0; r < world; ++r) {
      total += layout->owned_elements(r);
      most = std::max(most, layout->owned_elements(r));
      least = std::min(least, layout->owned_elements(r));
    }
    BOOST_TEST(total == kMlpParameters);                                    // every element has exactly one owner
    BOOST_TEST(most == (kMlpParameters + world - 1) / world);               // exact shares: ceil(N / W)
    BOOST_TEST(most - least <= world);                                      // the last rank may hold a few less
    BOOST_TEST(tl::distributed::ZeroOptimizerShard(layout, 0).piece_count() >= 1u);
  }
  // The largest tensor (fc2's weight, 256 of 435 elements) is split between ranks 0 and 1 for W = 2.
  BOOST_TEST(tl::distributed::FlatLayout(adam, 2).owned_elements(0) == 218);
  // A tensor listed twice (tied weights) has one place in the layout, one state, and counts once.
  std::vector<torch::Tensor> tied = net->parameters();
  tied.push_back(net->fc2->weight);
  torch::optim::Adam tied_adam(tied, torch::optim::AdamOptions(0.01));
  for (int world : {2, 3}) {
    int64_t total = 0;
    const tl::distributed::FlatLayout layout(tied_adam, world);
    for (int r = 0; r < world; ++r) total += layout.owned_elements(r);
    BOOST_TEST(total == kMlpParameters);
    BOOST_TEST(layout.same_parameters(tied_adam));
    BOOST_TEST(!layout.same_parameters(adam));
  }
  torch::optim::LBFGS lbfgs(net->parameters(), torch::optim::LBFGSOptions(0.1));
  try {
    tl::distributed::ZeroOptimizerShard::check_optimizer(lbfgs);
    BOOST_FAIL("ZeRO accepted LBFGS");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("ZeRO is on with optimizer LBFGS, whose state is one history for all "
                                              "parameters") != std::string::npos);
  }
  tl::ModeFlags flags;
  flags.zero = true;
  try {
    tl::mode_from_flags(flags);
    BOOST_FAIL("ZeRO was accepted with gpu mode single");
  } catch (const tl::ConfigurationError& error) {
    BOOST_TEST(std::string(error.what()).find("zero is 'on' with gpu mode 'single'; expected gpu mode ddp") !=
               std::string::npos);
  }
  flags.gpu_mode = "ddp";
  BOOST_TEST(std::get<tl::gpu_mode::DistributedDataParallel>(tl::mode_from_flags(flags).get()).zero());
}

// Levels 2 and 3 cut each unit (a submodule) in W chunks; units are named like FSDP's wrap policy.
BOOST_AUTO_TEST_CASE(sharding_units_are_the_named_submodules_and_bad_names_and_levels_are_named) {
  torch::manual_seed(5);
  Mlp net;
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(0.01));
  const auto children = tl::distributed::assign_units(*net, {});
  BOOST_TEST(children.names == (std::vector<std::string>{"fc1", "fc2", "fc3"}));
  BOOST_TEST(children.unit_of.at(net->fc2->bias.unsafeGetTensorImpl()) == 1);
  for (int world : {2, 3}) {
    const tl::distributed::FlatLayout layout(adam, world, children.unit_of);
    BOOST_TEST(layout.unit_count() == 3u);
    BOOST_TEST(layout.unit_length(1) == 272);
    BOOST_TEST(layout.unit_chunk(1) == (272 + world - 1) / world);
    int64_t total = 0;
    for (int r = 0; r < world; ++r) total += layout.owned_elements(r);
    BOOST_TEST(total == kMlpParameters);  // every element has exactly one owner
  }
  // One named unit: fc2's two tensors; fc1's and fc3's form the unit of the rest.
  const auto one = tl::distributed::assign_units(*net, {"fc2"});
  BOOST_TEST(one.names == (std::vector<std::string>{"fc2", ""}));
  BOOST_TEST(one.unit_of.at(net->fc1->weight.unsafeGetTensorImpl()) == 1);
  BOOST_TEST(tl::distributed::FlatLayout(adam, 2, one.unit_of).unit_length(1) == 112 + 51);
  auto error_of = [](const std::function<void()>& body) {
    try {
      body();
    } catch (const tl::ConfigurationError& error) {
      return std::string(error.what());
    }
    return std::string("no error");
  };
  BOOST_TEST(error_of([&] { tl::distributed::assign_units(*net, {"fc9"}); }) ==
             "trainloop: sharding unit 'fc9' names no submodule of the model; expected a dotted submodule path such "
             "as one of its children: fc1, fc2, fc3");
  BOOST_TEST(error_of([] { tl::distributed::sharding_named("fsdp"); }) ==
             "trainloop: sharding is 'fsdp'; expected none, optimizer, gradients or full");
  tl::ModeFlags flags;
  flags.sharding = "full";
  BOOST_TEST(error_of([&] { tl::mode_from_flags(flags); }) ==
             "trainloop: sharding is 'full' with gpu mode 'single'; expected gpu mode ddp or fsdp (sharding splits the "
             "model over their processes) or sharding none");
  // `--gpu-mode ddp --sharding full` is the sharded mode; `--sharding optimizer` is ddp's ZeRO-1.
  flags.gpu_mode = "ddp";
  BOOST_TEST(std::get<tl::gpu_mode::FullyShardedDataParallel>(tl::mode_from_flags(flags).get()).sharding() ==
             tl::distributed::Sharding::Full);
  flags.sharding = "optimizer";
  BOOST_TEST(std::get<tl::gpu_mode::DistributedDataParallel>(tl::mode_from_flags(flags).get()).zero());
  flags.gpu_mode = "fsdp";
  flags.sharding = "none";
  BOOST_TEST(std::get<tl::gpu_mode::FullyShardedDataParallel>(tl::mode_from_flags(flags).get()).sharding() ==
             tl::distributed::Sharding::Full);
  flags.comm_hook = "fp16";
  BOOST_TEST(error_of([&] { tl::mode_from_flags(flags); }) ==
             "trainloop: comm hook is 'fp16' with gpu mode 'fsdp'; expected gpu mode ddp (hooks carry DDP's all-reduced "
             "gradients between processes; sharded gradients are reduce-scattered) or comm hook none");
  BOOST_TEST(error_of([] {
               tl::gpu_mode::FullyShardedDataParallel().sharding(tl::distributed::Sharding::Optimizer).validate();
             }) == "trainloop: fsdp's sharding is optimizer; expected gradients or full (sharding none and optimizer are "
                   "gpu_mode::DistributedDataParallel, the latter with zero(true))");
}

/// What `f` throws as trainloop::Error, or "no error".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const tl::Error& e) {
    return std::string(e.what());
  }
  return std::string("no error");
}

// `--backend` chooses the collectives' library of ddp and fsdp; a name it does not know, and elastic
// training over NCCL (whose lost peer's communicator is not aborted and re-created yet), are named.
BOOST_AUTO_TEST_CASE(the_backend_flag_sets_the_library_and_elastic_training_is_refused_over_nccl) {
  tl::ModeFlags flags;
  flags.gpu_mode = "ddp";
  BOOST_TEST((std::get<tl::gpu_mode::DistributedDataParallel>(tl::mode_from_flags(flags).get()).backend() ==
              tl::distributed::Backend::Auto));
  flags.backend = "gloo";
  flags.gpu_mode = "fsdp";
  BOOST_TEST((std::get<tl::gpu_mode::FullyShardedDataParallel>(tl::mode_from_flags(flags).get()).backend() ==
              tl::distributed::Backend::Gloo));
  flags.backend = "mpi";
  BOOST_TEST(error_of([&] { tl::mode_from_flags(flags); }) == "trainloop: backend is 'mpi'; expected auto, gloo or nccl");
  const std::string refused = error_of([] {
    tl::gpu_mode::DistributedDataParallel().device_type(torch::kCPU).backend(tl::distributed::Backend::Nccl).elastic(true).validate();
  });
  BOOST_TEST(refused.rfind("trainloop: elastic training with backend nccl on the CPU; expected backend gloo (", 0) == 0, refused);
  BOOST_TEST(error_of([] {
               tl::gpu_mode::DistributedDataParallel().device_type(torch::kCPU).backend(tl::distributed::Backend::Gloo).elastic(true).validate();
             }) == "no error");
}

// More ranks on CUDA than the machine has devices: refused in the launching process, before any
// rank starts (this machine's count, whatever it is: none here, one or more on a GPU machine).
BOOST_AUTO_TEST_CASE(more_ranks_on_cuda_than_the_machine_has_devices_are_refused_before_any_starts) {
  const int devices = static_cast<int>(trainloop::detail::cuda_device_count());
  const std::string too_many = error_of([devices] {
    tl::gpu_mode::DistributedDataParallel().device_type(torch::kCUDA).procs_per_node(devices + 1).validate();
  });
  BOOST_TEST(too_many.find("procs_per_node is " + std::to_string(devices + 1) + " on CUDA, but this machine has " +
                           std::to_string(devices) + " visible CUDA device") != std::string::npos, too_many);
  BOOST_TEST(error_of([devices] {  // several ranks on one device, named: allowed (elastic over Gloo, tests)
               tl::gpu_mode::DistributedDataParallel().device_type(torch::kCUDA).procs_per_node(devices + 1).gpus(
                   std::vector<int>(static_cast<size_t>(devices + 1), 0)).validate();
             }) == "no error");
}

// Under torchrun a loop's ranks live on after a fit, holding the layout of the sharded parameters:
// a model whose parameters changed since is refused by name on every rank.
BOOST_AUTO_TEST_CASE(a_sharded_model_whose_parameters_change_between_fits_is_refused_naming_the_parameter) {
  const fs::path dir = fresh_dir("sharded_model_changes");
  const int port = tl::distributed::find_free_port();
  std::vector<FILE*> ranks;
  for (int rank = 0; rank < 2; ++rank) {
    const std::string command = "TMPDIR=" + dir.string() + " RANK=" + std::to_string(rank) + " LOCAL_RANK=" +
                                std::to_string(rank) + " WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" +
                                std::to_string(port) + " " + test_program("ddp_worker") + " sharded_model_changes 2 " + dir.string() +
                                " 2>&1";
    ranks.push_back(::popen(command.c_str(), "r"));
  }
  for (FILE* pipe : ranks) {
    std::string output;
    std::array<char, 4096> buffer{};
    while (size_t n = std::fread(buffer.data(), 1, buffer.size(), pipe)) output.append(buffer.data(), n);
    const int status = ::pclose(pipe);
    BOOST_TEST((WIFEXITED(status) && WEXITSTATUS(status) == 3), output);
    BOOST_TEST(output.find("the model's parameters changed since the last sharded fit: parameter 4 is 'fc3.weight' (a "
                           "new tensor or another name), was 'fc3.weight'") != std::string::npos, output);
  }
  BOOST_TEST(leftover_workers() == 0);
  fs::remove_all(dir);
}


// 20 steps of Adam with clipping: every sharding level equals plain DDP in the parameters and in
// every Adam moment (gathered into the checkpoint), and each rank holds about 1/W of the state.
BOOST_AUTO_TEST_CASE(every_sharding_level_with_adam_equals_plain_ddp_and_each_rank_holds_a_share_of_the_state) {
  for (int world : {2, 3}) {
    auto dir = fresh_dir("zero_vs_ddp_" + std::to_string(world));
    const std::string common = "TL_TEST_EPOCHS=4 TL_TEST_OPTIMIZER=adam TL_TEST_CLIP_PERCENT=50 ";
    auto ddp = run_worker("ckpt", world, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_ddp");
    BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
    const auto [ddp_moments, ddp_states] = adam_moments(dir / "ddp" / "last.ckpt");
    BOOST_TEST(ddp_states == 6);
    // Bytes of optimizer state on the rank holding the most: DDP the whole (2 moments x 4 bytes x 435).
    const double whole = 2 * 4 * kMlpParameters;
    BOOST_TEST(ddp.result["optimizer_state_bytes"] == whole);
    BOOST_TEST(ddp.result["optimizer_state_bytes_total"] == whole * world);
    for (const LevelCase& level : kLevels) {
      BOOST_TEST_CONTEXT("world " << world << ", sharding " << level.name) {
        auto zero = run_worker("ckpt", world, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                               std::string("_") + level.name);
        BOOST_REQUIRE_MESSAGE(zero.exit_code == 0, zero.output);
        BOOST_TEST(zero.result["steps"] == 20);
        const double params = (load_params((zero.dir / "params.pt").string()) - load_params((ddp.dir / "params.pt").string()))
                                  .abs().max().item<double>();
        const auto [zero_moments, zero_states] = adam_moments(dir / level.name / "last.ckpt");
        BOOST_TEST(zero_states == 6);  // the whole state, gathered from every rank
        BOOST_REQUIRE(zero_moments.sizes() == ddp_moments.sizes());
        const double moments = (zero_moments - ddp_moments).abs().max().item<double>();
        BOOST_TEST_MESSAGE("world " << world << ", sharding " << level.name << ", 20 Adam steps with clipping: max |level - ddp| "
                           "parameters " << params << ", moments " << moments << "; optimizer state on the rank holding "
                           "the most " << zero.result["optimizer_state_bytes"] << " bytes (ddp " << whole << ")");
        BOOST_TEST(params <= 1e-6);
        BOOST_TEST(moments <= 1e-6);
        // Exact shares: the rank holding the most has ceil(N / W) elements' moments (per unit at
        // levels 2 and 3), within one element per unit of 1/W, whatever the largest tensor.
        BOOST_TEST(zero.result["optimizer_state_bytes"] == 2 * 4 * most_owned_elements(level, world));
        // Every rank's bytes reach the History: each parameter's state is on exactly one rank.
        BOOST_TEST(zero.result["optimizer_state_ranks"] == world);
        BOOST_TEST(zero.result["optimizer_state_bytes_total"] == whole);
        fs::remove_all(zero.dir);
      }
    }
    fs::remove_all(ddp.dir);
    fs::remove_all(dir);
  }
}

// Without clipping nothing is summed in another order on 2 ranks: the reduce-scatter adds the same
// two numbers the all-reduce adds, so every level is plain DDP bit for bit. (On 3 ranks the
// reduce-scatter's sum order differs: 6e-8 after 20 steps, checked above with clipping.)
BOOST_AUTO_TEST_CASE(on_two_ranks_without_clipping_every_sharding_level_is_plain_ddp_bit_for_bit) {
  // Also with 2 micro-batches per step: the sharded levels keep whole local gradients until the
  // micro-batch that synchronizes, as plain DDP's no_sync does.
  for (const std::string accumulation : {"1", "2"}) {
    BOOST_TEST_CONTEXT("accumulation " << accumulation) {
      auto dir = fresh_dir("zero_bit_for_bit_" + accumulation);
      const std::string common = "TL_TEST_EPOCHS=4 TL_TEST_OPTIMIZER=adam TL_TEST_ACCUMULATION=" + accumulation + " ";
      auto ddp = run_worker("ckpt", 2, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_exact_ddp" + accumulation);
      BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
      const torch::Tensor ddp_params = load_params((ddp.dir / "params.pt").string());
      for (const LevelCase& level : kLevels) {
        BOOST_TEST_CONTEXT("sharding " << level.name) {
          auto run = run_worker("ckpt", 2, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                                std::string("_exact_") + level.name + accumulation);
          BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
          BOOST_TEST((load_params((run.dir / "params.pt").string()) - ddp_params).abs().max().item<double>() == 0.0);
          fs::remove_all(run.dir);
        }
      }
      fs::remove_all(ddp.dir);
      fs::remove_all(dir);
    }
  }
}

// A frozen layer still in the optimizer (a fine-tuned backbone) gets no gradient at any level, so
// AdamW's weight decay never touches it, as in plain DDP.
BOOST_AUTO_TEST_CASE(a_frozen_layer_in_the_optimizer_stays_as_it_was_at_every_sharding_level) {
  auto dir = fresh_dir("frozen_sharded");
  const std::string common = "TL_TEST_EPOCHS=2 TL_TEST_OPTIMIZER=adamw TL_TEST_FREEZE_FIRST=1 ";
  auto ddp = run_worker("ckpt", 2, 0, common + "TL_TEST_CKPT_DIR=" + (dir / "ddp").string(), "_frozen_ddp");
  BOOST_REQUIRE_MESSAGE(ddp.exit_code == 0, ddp.output);
  torch::manual_seed(5);
  Mlp initial;  // the worker's weights before training
  const torch::Tensor first_layer = flat_params(initial->fc1->parameters());
  const torch::Tensor ddp_params = load_params((ddp.dir / "params.pt").string());
  BOOST_TEST((ddp_params.narrow(0, 0, first_layer.numel()) - first_layer).abs().max().item<double>() == 0.0);
  for (const LevelCase& level : kLevels) {
    BOOST_TEST_CONTEXT("sharding " << level.name) {
      auto run = run_worker("ckpt", 2, 0, common + level.settings + "TL_TEST_CKPT_DIR=" + (dir / level.name).string(),
                            std::string("_frozen_") + level.name);
      BOOST_REQUIRE_MESSAGE(run.exit_code == 0, run.output);
      const torch::Tensor params = load_params((run.dir / "params.pt").string());
      BOOST_TEST((params.narrow(0, 0, first_layer.numel()) - first_layer).abs().max().item<double>() == 0.0);
      BOOST_TEST((params - ddp_params).abs().max().item<double>() <= 1e-6);
      fs::remove_all(run.dir);
    }
  }
  fs::remove_all(ddp.dir);
  fs::remove_all(dir);
}

// Each sharding level: killed and restarted, bit for bit; its checkpoints resume in plain DDP, in
// another world size and in one process, and plain DDP's resume in it.
BOOST_AUTO_TEST_CASE(every_sharding_level_restarts_bit_for_bit_and_its_checkpoints_resume_in_any_mode_and_world_size) {
  for (const LevelCase& level : kLevels) {
    BOOST_TEST_CONTEXT("sharding " << level.name) {
      auto dir = fresh_dir(std::string("zero_ckpt_") + level.name);
      const std::string adam = "TL_TEST_OPTIMIZER=adam ", zero = adam + level.settings;
      auto full = run_ckpt("zero_full", dir / "full", zero + "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2");
      BOOST_REQUIRE_MESSAGE(full.exit_code == 0, full.output);
      // Rank 1 killed at step 7 (inside epoch 2): all ranks restart from the step-6 checkpoint.
      auto killed = run_ckpt("zero_killed", dir / "killed",
                             zero + "TL_TEST_EPOCHS=3 TL_TEST_EVERY_STEPS=2 TL_TEST_KILL_AT_STEP=7 TL_TEST_MAX_RESTARTS=1");
      BOOST_REQUIRE_MESSAGE(killed.exit_code == 0, killed.output);
      BOOST_TEST(killed.output.find("restarting all ranks from the newest checkpoint") != std::string::npos);
      BOOST_TEST(torch::equal(load_params((killed.dir / "params.pt").string()), load_params((full.dir / "params.pt").string())));
      BOOST_TEST(leftover_workers() == 0);

      // 2 epochs with ZeRO, then the third in plain DDP from ZeRO's checkpoint: as 3 epochs of ZeRO.
      auto first = run_ckpt("zero_first", dir / "mixed", zero + "TL_TEST_EPOCHS=2");
      BOOST_REQUIRE_MESSAGE(first.exit_code == 0, first.output);
      fs::copy(dir / "mixed", dir / "three_ranks", fs::copy_options::recursive);
      fs::copy(dir / "mixed", dir / "back_to_zero", fs::copy_options::recursive);
      auto in_ddp = run_ckpt("ddp_second", dir / "mixed", adam + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
      BOOST_REQUIRE_MESSAGE(in_ddp.exit_code == 0, in_ddp.output);
      BOOST_TEST(in_ddp.result["epochs"] == 3);
      const double mixed = (load_params((in_ddp.dir / "params.pt").string()) - load_params((full.dir / "params.pt").string()))
                               .abs().max().item<double>();
      BOOST_TEST_MESSAGE("sharding " << level.name << ": 2 epochs sharded + 1 epoch plain DDP vs 3 epochs sharded: max |diff| " << mixed);
      BOOST_TEST(mixed <= 1e-6);
      // ... and plain DDP's checkpoint of epoch 3 continues in ZeRO; ZeRO's in 3 ranks (another world size).
      auto ddp_then_zero = run_ckpt("zero_third", dir / "mixed", zero + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last");
      BOOST_REQUIRE_MESSAGE(ddp_then_zero.exit_code == 0, ddp_then_zero.output);
      BOOST_TEST(ddp_then_zero.result["epochs"] == 4);
      auto three = run_worker("ckpt", 3, 0, zero + "TL_TEST_EPOCHS=1 TL_TEST_RESUME=last TL_TEST_CKPT_DIR=" +
                                                (dir / "three_ranks").string(), "_zero_three");
      BOOST_REQUIRE_MESSAGE(three.exit_code == 0, three.output);
      BOOST_TEST(three.result["epochs"] == 3);
      BOOST_TEST(adam_moments(dir / "three_ranks" / "last.ckpt").second == 6);
      // ... and in one process, with every parameter's Adam state.
      torch::manual_seed(5);
      Mlp net;
      torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(0.01));
      tl::TrainLoop<Mlp> one(net, make_data(40, 1), {}, optimizer, torch::nn::CrossEntropyLoss(),
                             tl::TrainLoopOptions().batch_size(8));
      one.load_checkpoint(dir / "back_to_zero" / "last.ckpt");
      BOOST_TEST(optimizer.state().size() == 6u);
      BOOST_TEST(tl::optimizer_state_bytes(optimizer) == 2 * 4 * kMlpParameters);
      for (auto* run : {&full, &killed, &first, &in_ddp, &ddp_then_zero, &three}) fs::remove_all(run->dir);
      fs::remove_all(dir);
    }
  }
}
