#pragma once
/// @file
/// @brief ShardedState: what a multi-process engine keeps when its ranks hold parts of the
/// optimizer state (DDP with zero(true), ZeRO-1) or also of the gradients and parameters
/// (FullyShardedDataParallel) — the flat layout (flat_layout.hpp), this rank's optimizer shard
/// (zero_optimizer_shard.hpp), its own chunk of each unit (fsdp at full) — and everything done
/// with them besides the step: a fit's start, this rank's shares of a per-rank checkpoint
/// (shard_checkpoint.hpp) and their reading back, and a whole state saved (gathered on the
/// writing rank) or loaded (each rank keeping its share). gpu_mode/rank_engine.hpp holds one
/// for both engines and forwards the checkpoint members to it once.
///
/// Its states, explicit (a caller asks state(), never which members exist):
/// - Replicated: the mode shards nothing (DDP without zero): every rank holds the whole state;
/// - OneRank: a sharding mode on one rank: nothing to shard, it trains as gpu_mode::Single;
/// - Unlaid: sharding, no layout yet (before the first fit, or a per-rank checkpoint's load):
///   the state is whole on every rank;
/// - LaidOutByLoad: a per-rank checkpoint's load laid the parameters out and no fit used the
///   layout yet (a spawned rank replaying an earlier fit may drop it: drop_unused_layout);
/// - InUse: a fit uses the layout, the same in every later fit (the optimizer keys this rank's
///   state by its pieces); this rank's optimizer holds only its share from then on.

#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/shard_checkpoint.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/optimizer_state.hpp>

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::distributed {

/// @brief This rank's sharded state and what is done with it (see the file comment).
class ShardedState {
 public:
  /// The states of the file comment.
  enum class State { Replicated, OneRank, Unlaid, LaidOutByLoad, InUse };
  /// The units the layout groups parameters in (TensorImpl address to unit index; empty: one unit).
  using UnitsOf = std::function<std::unordered_map<const void*, int>()>;

  /// Replicated: nothing sharded.
  ShardedState() = default;
  ShardedState(const ShardedState&) = delete;
  ShardedState& operator=(const ShardedState&) = delete;

  /// @brief Makes a Replicated state a sharding mode's, Unlaid (an engine's constructor says so).
  /// `own_chunks`: the parameters too are sharded (fsdp at full): each rank keeps its chunk of
  /// every unit here. `units`: the units of the layout (null: one, ZeRO-1's flat space).
  void shard(bool own_chunks, UnitsOf units) {
    TRAINLOOP_CHECK(state_ == State::Replicated, "a sharded state was made sharded twice; expected once, by its engine");
    state_ = State::Unlaid;
    own_chunks_wanted_ = own_chunks;
    units_ = std::move(units);
  }

  State state() const { return state_; }  ///< where this rank's sharded state is (the file comment)
  /// Whether this rank holds only its share of the optimizer state (laid out, by a fit or a load).
  bool holds_share() const { return state_ == State::LaidOutByLoad || state_ == State::InUse; }
  /// This rank's pieces and their optimizer state (holds_share() only).
  ZeroOptimizerShard& shard() { return *shard_; }
  /// The layout (holds_share() only).
  const std::shared_ptr<const FlatLayout>& layout() const { return layout_; }
  /// This rank's chunk of every unit (fsdp at full), the only copy of those values between steps.
  const std::vector<torch::Tensor>& own_chunks() const { return own_chunks_; }

  /// @brief A fit's start on every rank (rank `rank` of `world`): the optimizer checked, then on
  /// one rank OneRank (returns false: nothing sharded); otherwise `checks()` (a mode's own checks
  /// of the model, before anything is laid out), the layout made once and this rank's share kept
  /// of a whole state loaded before (returns true).
  /// @throws trainloop::ConfigurationError for an optimizer that cannot step pieces, or parameters
  ///         other than the last fit's (each rank holds only its share of those).
  bool begin_fit(torch::optim::Optimizer& optimizer, int world, int rank, const std::function<void()>& checks = {}) {
    if (state_ == State::Replicated) return false;
    ZeroOptimizerShard::check_optimizer(optimizer);
    drop_unused_layout(optimizer);
    TRAINLOOP_CHECK(!shard_ || shard_->layout().same_parameters(optimizer), "the optimizer's parameters changed since "
                    "the last sharded fit, and each rank holds only the state of its share of the old ones; expected the "
                    "same parameter groups in every sharded fit of this loop (or a checkpoint written before the change, "
                    "which holds the whole state, resumed by a new loop)");
    optimizer_ = &optimizer;
    if (world == 1) {
      state_ = State::OneRank;
      return false;
    }
    if (checks) checks();
    lay_out(optimizer, world, rank);
    state_ = State::InUse;
    shard_->keep_own_share(optimizer);  // a whole state loaded before this fit keeps this rank's pieces
    return true;
  }

  /// @brief This rank's shares of a per-rank checkpoint: its pieces of the parameters (read from
  /// the pieces when `values_from_pieces`: fsdp at full, whose parameters are freed between uses)
  /// and their optimizer state; views, no copy. holds_share() only.
  std::vector<TensorShare> shares(const torch::nn::Module& module, torch::optim::Optimizer& optimizer, bool values_from_pieces) {
    shard_->layout().check_same_parameters(optimizer);  // (inside the write: a failure is agreed)
    return zero_checkpoint_shares(*shard_, module, optimizer, values_from_pieces);
  }

  /// @brief Resuming from a per-rank checkpoint on rank `rank` of `world` (> 1): lays the
  /// parameters out as the fit will (LaidOutByLoad, unless a fit did) and reads only this rank's
  /// pieces of the optimizer state, whatever world size wrote it. False when nothing is sharded
  /// (the loop then loads every parameter's whole state).
  bool load_shares(torch::optim::Optimizer& optimizer, const torch::nn::Module& module, ShareSource& source, int world,
                   int rank) {
    if (state_ == State::Replicated) return false;
    ZeroOptimizerShard::check_optimizer(optimizer);
    drop_unused_layout(optimizer);
    if (!shard_) {
      lay_out(optimizer, world, rank);
      state_ = State::LaidOutByLoad;
    }
    shard_->layout().check_same_parameters(optimizer);
    load_zero_optimizer_shares(*shard_, module, optimizer, source);
    return true;
  }

  /// @brief Writes `optimizer`'s whole state into `archive` on each rank where `writes`: while
  /// this rank holds a share, a collective — each writing rank in turn gathers every rank's share,
  /// writes and lets it go; otherwise (no group: the launching process; nothing laid out) the
  /// writer's own state.
  void save_whole(ProcessGroup* group, torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive,
                  bool writes) {
    if (group == nullptr || !holds_share()) {
      if (writes) ::trainloop::detail::save_optimizer_state(optimizer, archive);
      return;
    }
    const torch::Tensor writers = group->all_gather(torch::full({1}, writes ? 1 : 0, torch::kInt64)).reshape({-1});
    for (int root = 0; root < group->world_size(); ++root) {
      if (writers[root].item<int64_t>() == 0) continue;
      struct Release {  // the root lets the gathered state go, also when writing throws
        ZeroOptimizerShard& shard;
        torch::optim::Optimizer& optimizer;
        ~Release() { shard.release_gathered(optimizer); }
      } release{*shard_, optimizer};
      shard_->gather_state(optimizer, *group, root);
      if (root == group->rank()) ::trainloop::detail::save_optimizer_state(optimizer, archive);
    }
  }

  /// @brief Elastic training, after a lost rank: the layout of the old world size is dropped with
  /// this rank's pieces' optimizer state (Unlaid), so the survivors' next fit lays the state out
  /// for the new world size and reads its share from the hand-off (distributed/elastic/share_copies.hpp).
  void forget_layout() {
    if (!holds_share()) return;
    if (optimizer_ != nullptr) {
      auto& state = optimizer_->state();
      shard_->for_each_piece([&](const auto&, const torch::Tensor& view) {
        state.erase(::trainloop::detail::optimizer_state_key(state, view));
      });
    }
    shard_.reset();
    layout_.reset();
    own_chunks_.clear();
    state_ = State::Unlaid;
  }

  /// @brief Loads a whole state (any mode's checkpoint) of which this rank keeps its share.
  void load_whole(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    drop_unused_layout(optimizer);
    ::trainloop::detail::load_optimizer_state(optimizer, archive);
    if (holds_share()) shard_->keep_own_share(optimizer);
  }

 private:
  /// A layout a per-rank checkpoint's load made for other parameters than `optimizer`'s, which
  /// no fit used (a spawned rank replaying an earlier fit): dropped, so the next load or fit lays
  /// out anew.
  void drop_unused_layout(const torch::optim::Optimizer& optimizer) {
    if (state_ != State::LaidOutByLoad || shard_->layout().same_parameters(optimizer)) return;
    shard_.reset();
    layout_.reset();
    own_chunks_.clear();
    state_ = State::Unlaid;
  }
  /// The layout and this rank's pieces (at full, views of its own chunks), made once.
  void lay_out(const torch::optim::Optimizer& optimizer, int world, int rank) {
    if (shard_) return;
    layout_ = std::make_shared<const FlatLayout>(optimizer, world, units_ ? units_() : std::unordered_map<const void*, int>{});
    if (own_chunks_wanted_) {
      const auto& distinct = layout_->distinct();
      for (size_t u = 0; u < layout_->unit_count(); ++u) {
        own_chunks_.push_back(torch::zeros({layout_->unit_chunk(u)}, distinct.empty() ? torch::TensorOptions()
                                                                                      : distinct.front().options()));
      }
    }
    shard_.emplace(layout_, rank, own_chunks_);
  }

  State state_ = State::Replicated;
  torch::optim::Optimizer* optimizer_ = nullptr;  // the last fit's (forget_layout drops its pieces' state)
  bool own_chunks_wanted_ = false;
  UnitsOf units_;
  std::shared_ptr<const FlatLayout> layout_;
  std::vector<torch::Tensor> own_chunks_;
  std::optional<ZeroOptimizerShard> shard_;
};

}  // namespace trainloop::distributed
