#pragma once
/// @file
/// @brief ZeRO stage 1 (Rajbhandari et al. 2020; PyTorch's ZeroRedundancyOptimizer): the optimizer
/// state sharded over DDP's ranks. Each parameter has one owner rank; only the owner keeps its
/// optimizer state and steps it, then sends the updated values to every rank.
///
/// How it runs, per optimizer step (gpu_mode::DistributedDataParallel::zero):
/// 1. The gradient reducer all-reduces the gradients as in plain DDP, so every rank holds the
///    whole averaged gradient: clipping by the local norm *is* the global norm, and fp16's
///    overflow check agrees as before (nothing else in the loop changes).
/// 2. step(): the user's optimizer steps with each param group narrowed to the parameters this
///    rank owns (the groups are put back right after, so options, schedules and zero_grad()
///    keep seeing every parameter). libtorch's optimizers make a parameter's state at its first
///    step (Adagrad at construction: begin_fit drops the others' then), so this rank never holds
///    the state of a parameter it does not own.
/// 3. Every owner broadcasts its updated parameters that require grad (ProcessGroup::broadcast:
///    tensors of 256 KiB and more in place, the rest in one flat buffer), so no rank holds a
///    second copy of the model; a frozen backbone is not sent.
///
/// Gradients travel as an all-reduce, not a reduce-scatter: libtorch 1.13's Gloo has no
/// reduce_scatter (ProcessGroup::reduce_scatter_sum), and an all-reduce keeps every other feature
/// (accumulation, clipping, comm hooks, exact uneven batches) unchanged. The bytes on the wire per
/// step are DDP's plus one copy of the parameters; the memory saved is (W-1)/W of the state.
///
/// Checkpoints hold the whole state in libtorch's layout (gather_state() on save), so a ZeRO
/// checkpoint resumes in plain DDP, single, dp, or ZeRO with another world size; loading any
/// checkpoint loads the whole state and drop_state_of_others() keeps this rank's share.
///
/// Ownership: distinct parameter tensors (a tensor tied into two places, or listed in two param
/// groups, has one owner and one state) sorted by element count, largest first, each to the
/// rank holding the fewest elements so far (ties: the lower rank) — every rank's share is within
/// one parameter of 1/W of the elements, and every rank computes the same owners from the same
/// parameter list.
///
/// Memory at a checkpoint: the root deserializes the other ranks' shares on the CPU (never on
/// its GPU) and lets them go once written; it receives them in one gather (W rows of the
/// largest share's bytes). Loading reads the whole state, then each rank keeps its share.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace trainloop::distributed {

/// @brief Which rank owns each parameter of an optimizer, and the three collectives of ZeRO-1:
/// step, gather of the whole state (for a checkpoint), and keeping one's share after a load.
class ZeroOptimizerShard {
 public:
  /// @throws trainloop::ConfigurationError when `optimizer` keeps state that is not per parameter.
  static void check_optimizer(const torch::optim::Optimizer& optimizer) {
    // LBFGS keeps one state for all parameters (its history of directions), keyed by the first
    // parameter: sharding it by parameter would split what cannot be split.
    if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer) != nullptr) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer LBFGS, whose state is one history for all "
                               "parameters, not per parameter; expected an optimizer with state per parameter "
                               "(SGD, Adam, AdamW, Adagrad, RMSprop) or zero off");
    }
  }

  /// Assigns every parameter of `optimizer` (its param groups in order) an owner among `world_size` ranks.
  ZeroOptimizerShard(const torch::optim::Optimizer& optimizer, int rank, int world_size)
      : rank_(rank), world_size_(world_size) {
    check_optimizer(optimizer);
    std::unordered_map<const void*, size_t> distinct_index;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        auto [found, added] = distinct_index.emplace(parameter.unsafeGetTensorImpl(), distinct_.size());
        if (added) distinct_.push_back(parameter);
        parameters_.push_back(parameter);
        distinct_of_.push_back(found->second);
      }
    }
    std::vector<size_t> order(distinct_.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t a, size_t b) { return distinct_[a].numel() > distinct_[b].numel(); });
    elements_.assign(static_cast<size_t>(world_size_), 0);
    distinct_owner_.assign(distinct_.size(), 0);
    owned_by_.assign(static_cast<size_t>(world_size_), {});
    for (size_t index : order) {
      const auto least = std::min_element(elements_.begin(), elements_.end()) - elements_.begin();
      distinct_owner_[index] = static_cast<int>(least);
      elements_[static_cast<size_t>(least)] += distinct_[index].numel();
    }
    for (size_t d = 0; d < distinct_.size(); ++d) owned_by_[static_cast<size_t>(distinct_owner_[d])].push_back(distinct_[d]);
  }

  /// The rank that owns parameter `index` (param groups in order).
  int owner(size_t index) const { return distinct_owner_.at(distinct_of_.at(index)); }
  /// Elements of the parameters rank `r` owns.
  int64_t owned_elements(int r) const { return elements_.at(static_cast<size_t>(r)); }

  /// Whether `optimizer` holds the parameters the owners were assigned for, in the same order.
  bool same_parameters(const torch::optim::Optimizer& optimizer) const {
    size_t index = 0;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        if (index >= parameters_.size() || !parameter.is_same(parameters_[index])) return false;
        ++index;
      }
    }
    return index == parameters_.size();
  }

  /// Steps this rank's parameters with `optimizer`, then every owner broadcasts its parameters
  /// that require grad (the same on every rank). A collective: every rank calls it after the
  /// same reduction.
  void step(torch::optim::Optimizer& optimizer, ProcessGroup& group) {
    check_same_parameters(optimizer);
    {
      NarrowedGroups narrowed(optimizer, *this);
      optimizer.step();
    }
    for (int r = 0; r < world_size_; ++r) {
      std::vector<torch::Tensor> trained;
      for (const auto& parameter : owned_by_[static_cast<size_t>(r)]) {
        if (parameter.requires_grad()) trained.push_back(parameter);
      }
      if (!trained.empty()) group.broadcast(trained, r);
    }
  }

  /// Erases the state of every parameter this rank does not own (after loading a whole state).
  void drop_state_of_others(torch::optim::Optimizer& optimizer) const {
    check_same_parameters(optimizer);
    auto& state = optimizer.state();
    for (size_t d = 0; d < distinct_.size(); ++d) {
      if (distinct_owner_[d] != rank_) state.erase(::trainloop::detail::optimizer_state_key(state, distinct_[d]));
    }
  }

  /// A collective: every rank sends the state it owns to `root`, which adds it to its optimizer
  /// (on the CPU), so that `root`'s optimizer holds the whole state (in libtorch's layout) until
  /// release_gathered(). Only `root` ever holds more than its share, and only until then.
  void gather_state(torch::optim::Optimizer& optimizer, ProcessGroup& group, int root) {
    check_same_parameters(optimizer);
    auto& state = optimizer.state();
    torch::serialize::OutputArchive mine;
    for (size_t d = 0; d < distinct_.size(); ++d) {
      auto found = state.find(::trainloop::detail::optimizer_state_key(state, distinct_[d]));
      if (distinct_owner_[d] != rank_ || found == state.end()) continue;
      torch::serialize::OutputArchive one;
      found->second->serialize(one);
      mine.write(std::to_string(d), one);
    }
    std::ostringstream stream;
    if (rank_ != root) mine.save_to(stream);  // the root's own state stays where it is
    const std::string bytes = stream.str();
    torch::Tensor local = torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                                           torch::kUInt8);
    const std::vector<torch::Tensor> received = group.gather_rows_to(local, root);
    for (int r = 0; r < world_size_ && rank_ == root; ++r) {
      if (r == root || received[static_cast<size_t>(r)].numel() == 0) continue;
      const torch::Tensor& from = received[static_cast<size_t>(r)];
      torch::serialize::InputArchive archive;
      archive.load_from(reinterpret_cast<const char*>(from.data_ptr<uint8_t>()), static_cast<size_t>(from.numel()),
                        torch::Device(torch::kCPU));
      for (const auto& key : archive.keys()) {
        const size_t d = std::stoull(key);
        torch::serialize::InputArchive one;
        archive.read(key, one);
        std::unique_ptr<torch::optim::OptimizerParamState> param_state = new_param_state(optimizer);
        param_state->serialize(one);
        state[::trainloop::detail::optimizer_state_key(state, distinct_.at(d))] = std::move(param_state);
        gathered_.push_back(d);
      }
    }
  }

  /// Erases what gather_state() added on the root (a no-op elsewhere).
  void release_gathered(torch::optim::Optimizer& optimizer) noexcept {
    for (size_t d : gathered_) optimizer.state().erase(::trainloop::detail::optimizer_state_key(optimizer.state(), distinct_[d]));
    gathered_.clear();
  }

 private:
  /// The optimizer's param groups narrowed to this rank's parameters while it lives.
  class NarrowedGroups {
   public:
    NarrowedGroups(torch::optim::Optimizer& optimizer, const ZeroOptimizerShard& shard) : optimizer_(optimizer) {
      saved_.reserve(optimizer_.param_groups().size());  // no allocation between narrowing and saving
      size_t index = 0;
      for (auto& group : optimizer_.param_groups()) {
        std::vector<torch::Tensor> mine;
        for (const auto& parameter : group.params()) {
          if (shard.owner(index++) == shard.rank_) mine.push_back(parameter);
        }
        saved_.push_back(std::move(group.params()));
        group.params() = std::move(mine);
      }
    }
    NarrowedGroups(const NarrowedGroups&) = delete;
    NarrowedGroups& operator=(const NarrowedGroups&) = delete;
    ~NarrowedGroups() {
      auto& groups = optimizer_.param_groups();
      for (size_t g = 0; g < saved_.size(); ++g) groups[g].params() = std::move(saved_[g]);
    }

   private:
    torch::optim::Optimizer& optimizer_;
    std::vector<std::vector<torch::Tensor>> saved_;
  };


  /// A parameter state of `optimizer`'s type, for the root to deserialize another rank's into.
  static std::unique_ptr<torch::optim::OptimizerParamState> new_param_state(const torch::optim::Optimizer& optimizer) {
    namespace optim = torch::optim;
    if (dynamic_cast<const optim::AdamW*>(&optimizer)) return std::make_unique<optim::AdamWParamState>();
    if (dynamic_cast<const optim::Adam*>(&optimizer)) return std::make_unique<optim::AdamParamState>();
    if (dynamic_cast<const optim::SGD*>(&optimizer)) return std::make_unique<optim::SGDParamState>();
    if (dynamic_cast<const optim::Adagrad*>(&optimizer)) return std::make_unique<optim::AdagradParamState>();
    if (dynamic_cast<const optim::RMSprop*>(&optimizer)) return std::make_unique<optim::RMSpropParamState>();
    // A user's optimizer: a copy of a state the root holds has its type (serialize() then overwrites it).
    TRAINLOOP_CHECK(!optimizer.state().empty(), "ZeRO cannot gather the state of this optimizer on the rank that "
                    "writes the checkpoint: its state type is not one of libtorch's and that rank holds none to copy; "
                    "expected SGD, Adam, AdamW, Adagrad, RMSprop, or the writing rank owning a parameter with state");
    return optimizer.state().begin()->second->clone();
  }

  /// The optimizer must still hold the parameters the owners were assigned for.
  void check_same_parameters(const torch::optim::Optimizer& optimizer) const {
    TRAINLOOP_CHECK(same_parameters(optimizer), "the optimizer's parameters changed since ZeRO assigned their "
                    "owners (", parameters_.size(), " then); expected the parameter groups the fit began with");
  }

  int rank_ = 0;
  int world_size_ = 1;
  std::vector<torch::Tensor> parameters_;             // param groups in order, a tied tensor as often as listed
  std::vector<size_t> distinct_of_;                   // parameters_[i] is distinct_[distinct_of_[i]]
  std::vector<torch::Tensor> distinct_;               // each tensor once, in first-listed order
  std::vector<int> distinct_owner_;                   // owner of distinct_[d]
  std::vector<int64_t> elements_;                     // elements each rank owns
  std::vector<std::vector<torch::Tensor>> owned_by_;  // each rank's distinct tensors, in order
  std::vector<size_t> gathered_;                      // distinct indices gather_state() added on the root
};

}  // namespace trainloop::distributed
