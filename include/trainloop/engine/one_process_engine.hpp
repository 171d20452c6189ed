#pragma once
/// @file
/// @brief OneProcessEngine: the members of the mode interface (engine/mode_engine.hpp) that every
/// engine training in one process writes the same way — it is rank 0 of 1, its collectives are
/// identities, and it has nothing to join, attach or finish. Derive from it and write only what
/// your mode does: the batch members (train_micro_batch, eval_batch), device(), and whichever of
/// these it does differently (a derived member hides the base's).
///
/// @code
/// template <class Module>
/// class ChunkedEngine : public trainloop::OneProcessEngine {
///  public:
///   ChunkedEngine(const Chunked& mode, std::shared_ptr<Module> module);
///   template <class Batch, class Forward, class Sink>
///   void train_micro_batch(const Batch&, Forward&&, double loss_scale, bool synchronize, Sink&&);
///   template <class Batch, class Forward, class Sink>
///   void eval_batch(const Batch&, Forward&&, Sink&&);
/// };
/// @endcode

#include <trainloop/engine/mode_engine.hpp>

#include <torch/torch.h>

#include <cstdint>

namespace trainloop {

/// @brief The identity members of a one-process engine (this file's comment).
class OneProcessEngine {
 public:
  /// This process prints and writes files.
  bool is_main() const { return true; }
  /// Rank 0 ...
  int64_t rank() const { return 0; }
  /// ... of 1.
  int64_t world_size() const { return 1; }
  /// The CPU; a mode on another device defines its own.
  torch::Device device() const { return torch::Device(torch::kCPU); }
  /// Every dataset whole.
  DataShard data_shard() const { return {}; }
  /// A sum over one rank: the tensor itself.
  void all_reduce_sum(torch::Tensor&) {}
  /// One rank's tensor, stacked: [1, ...].
  torch::Tensor all_gather(const torch::Tensor& tensor) { return tensor.unsqueeze(0); }
  /// One rank agrees with itself.
  bool any_rank(bool flag) { return flag; }
  /// Nobody to wait for.
  void barrier() {}
  /// Nothing to place or join.
  void prepare() {}
  /// Nothing lives only during a fit.
  void begin_fit(torch::optim::Optimizer&) {}
  /// Nothing to remove after a fit.
  void end_fit() noexcept {}
  /// No gradient reduction to finish.
  void before_optimizer_step() {}
  /// No replica to refresh.
  void after_optimizer_step() {}
};

}  // namespace trainloop
