#pragma once
/// @file
/// @brief gpu_mode::FullyShardedDataParallel, the policy: what each rank keeps only 1/W of, the
/// sharding units and the model after fit (its engine: gpu_mode/fully_sharded_data_parallel.hpp).

#include <trainloop/distributed/zero/sharding.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/multi_process.hpp>

#include <torch/torch.h>

#include <string>
#include <vector>

namespace trainloop {
namespace detail {
template <class Module>
class FullyShardedEngine;
}

namespace gpu_mode {

/// @brief Sharded data parallel training, in the style of PyTorch's FSDP:
/// `gpu_mode::FullyShardedDataParallel().procs_per_node(4)` (or `--gpu-mode fsdp`, or
/// `--gpu-mode ddp --sharding full`). The processes, devices and limits are
/// gpu_mode::MultiProcess's settings; these are the sharding's.
struct FullyShardedDataParallel : MultiProcess<FullyShardedDataParallel> {
  /// Name used by gpu_mode::parse and in messages.
  static constexpr const char* name = "fsdp";
  /// The engine the loop runs for a model whose module type is `Module`.
  template <class Module>
  using engine = detail::FullyShardedEngine<Module>;

  /// What each rank keeps only 1/W of besides the optimizer state (distributed/zero/sharding.hpp):
  /// Sharding::Gradients (ZeRO-2) or Sharding::Full (ZeRO-3, the default).
  TORCH_ARG(distributed::Sharding, sharding) = distributed::Sharding::Full;
  /// The submodules (dotted paths, as named_modules() prints them) whose parameters are reduced
  /// and gathered together, like FSDP's auto-wrap policy; empty: the model's top-level children.
  /// Parameters of no unit form one more unit.
  TORCH_ARG(std::vector<std::string>, sharding_units) = {};
  /// At sharding full: whether a fit ends with every rank's model whole (the default: a
  /// collective gather of every unit, so the model after fit() is the trained one). false, for a
  /// model that does not fit one rank: each rank keeps only its chunks after fit(); its model's
  /// parameters keep their sizes but have no memory (read them through this loop: evaluate(),
  /// predict() and save_checkpoint() gather what they need; a checkpoint holds the trained
  /// weights whole). Ranks started by torchrun, srun or mpirun only: a rank trainloop's launcher
  /// spawned hands its model to the launching process whole (refused there by name). A later
  /// fit() of the same ranks gathers the model whole once at its start (every rank's state is
  /// checked against rank 0's).
  TORCH_ARG(bool, whole_model_after_fit) = true;

 public:  // TORCH_ARG leaves the section private.
  /// @brief Throws trainloop::Error naming the first option out of range.
  void validate() const {
    validate_processes();
    TRAINLOOP_CHECK(sharding_ == distributed::Sharding::Gradients || sharding_ == distributed::Sharding::Full,
                    "fsdp's sharding is ", distributed::sharding_name(sharding_), "; expected gradients or full "
                    "(sharding none and optimizer are gpu_mode::DistributedDataParallel, the latter with zero(true))");
  }
};

}  // namespace gpu_mode
}  // namespace trainloop
