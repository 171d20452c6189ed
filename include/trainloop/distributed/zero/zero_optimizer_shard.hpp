#pragma once
/// @file
/// @brief ZeRO stage 1 (Rajbhandari et al. 2020; DeepSpeed's and FSDP's flat partition): the
/// optimizer state sharded over DDP's ranks in exact 1/W shares. The parameters are laid end to
/// end in one flat index space (each tensor in its own memory order, a tied tensor once); rank r
/// owns the contiguous range [r*C, (r+1)*C) of it, C = ceil(N/W) for N elements, so every rank
/// holds the state of C elements or fewer whatever the model: a tensor is split where a range
/// ends (the example's fc1, 95% of its CNN, no longer sits on one rank).
///
/// How it runs, per optimizer step (gpu_mode::DistributedDataParallel::zero):
/// 1. The gradient reducer all-reduces the gradients as in plain DDP, so every rank holds the
///    whole averaged gradient: clipping by the local norm *is* the global norm, and fp16's
///    overflow check agrees as before (nothing else in the loop changes).
/// 2. step(): each of this rank's pieces is a 1-D view of its parameter's storage, with the
///    matching slice of the gradient as its grad; the user's optimizer steps with each param
///    group holding those views instead of the parameters (put back right after, so options,
///    schedules and zero_grad() keep seeing the parameters). The optimizer keys its state by
///    the views: this rank never holds state beyond its range. Only optimizers whose update is per
///    element can step a piece of a tensor (SGD, Adam, AdamW, Adagrad, RMSprop: bit for bit the
///    same as stepping the whole tensor); others are refused by check_optimizer().
/// 3. Every owner broadcasts its pieces into every rank's parameters, in place (broadcast_pieces:
///    the same bytes as an all-gather of the ranges, without staging copies).
///
/// Gradients travel as an all-reduce, not a reduce-scatter: an all-reduce keeps every other
/// feature (accumulation, clipping, comm hooks, exact uneven batches) unchanged. The memory saved
/// is (W-1)/W of the state.
///
/// gpu_mode::FullyShardedDataParallel lays the parameters out by *unit* (distributed/zero/flat_layout.hpp),
/// reduce-scatters each unit's gradients into its owners' chunks (distributed/zero/unit_gradients.hpp)
/// and steps the pieces with those chunks as their gradients (step_pieces); at level full the
/// pieces are views of this rank's own chunk of each unit (distributed/zero/unit_parameters.hpp),
/// the only copy of those values between steps. The layout is the engine's; this class owns only
/// the pieces' views and their optimizer state.
///
/// Checkpoints hold the whole state in libtorch's layout, one state per parameter (gather_state()
/// joins the pieces on the writing rank), so a ZeRO checkpoint resumes in plain DDP, single, dp,
/// or ZeRO with another world size; loading any checkpoint loads the whole state and
/// keep_own_share() cuts this rank's pieces out of it.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/detail/type_name.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <vector>

namespace trainloop::distributed {

/// @brief This rank's pieces of the flat layout with their optimizer state: the step of its
/// share, the gather of the whole state (for a checkpoint), its release, and keeping one's share
/// of a whole state loaded.
class ZeroOptimizerShard {
 public:
  /// @throws trainloop::ConfigurationError when `optimizer` cannot step a piece of a tensor.
  static void check_optimizer(const torch::optim::Optimizer& optimizer) {
    // LBFGS keeps one state for all parameters (its history of directions), keyed by the first
    // parameter: sharding it would split what cannot be split.
    if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer) != nullptr) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer LBFGS, whose state is one history for all "
                               "parameters, not per parameter; expected an optimizer with state per parameter "
                               "(SGD, Adam, AdamW, Adagrad, RMSprop), or zero off (ddp) / gpu mode ddp (fsdp)");
    }
    // A user's optimizer may compute per-tensor quantities (LAMB's and LARS's trust ratios use the
    // norm of the whole tensor): stepping a piece would change its result without a word.
    if (!detail::steps_per_element(optimizer)) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer " + ::trainloop::detail::demangled(typeid(optimizer).name()) +
                               ", which trainloop cannot prove updates each element on its own (ZeRO steps pieces "
                               "of tensors); expected SGD, Adam, AdamW, Adagrad or RMSprop, or zero off (ddp) / gpu mode ddp (fsdp)");
    }
  }

  /// This rank's pieces of `layout` as views of the parameters (ZeRO-1, sharded gradients), or,
  /// given `chunks` (one tensor per unit: this rank's own chunk of it, sharded parameters), as
  /// views of those.
  ZeroOptimizerShard(std::shared_ptr<const FlatLayout> layout, int rank, std::vector<torch::Tensor> chunks = {})
      : layout_(std::move(layout)), rank_(rank) {
    TRAINLOOP_CHECK(chunks.empty() || chunks.size() == layout_->unit_count(), "ZeRO was given ", chunks.size(),
                    " chunks for ", layout_->unit_count(), " units; expected one per unit, or none");
    piece_of_.assign(layout_->distinct().size(), -1);
    for (const FlatLayout::Piece& piece : layout_->pieces_of(rank_)) {
      piece_of_[piece.distinct] = static_cast<int64_t>(pieces_.size());
      torch::Tensor view = chunks.empty()
                               ? detail::flat_view(layout_->distinct()[piece.distinct]).narrow(0, piece.in_tensor, piece.length)
                               : chunks[piece.unit].narrow(0, piece.in_chunk, piece.length);
      pieces_.push_back(OwnedPiece{piece, std::move(view)});
    }
  }

  /// The layout the pieces are cut from.
  const FlatLayout& layout() const { return *layout_; }
  /// How many pieces of tensors this rank owns (a tensor split at a range's end counts on both ranks).
  size_t piece_count() const { return pieces_.size(); }
  /// Calls f(where, view) for each of this rank's pieces, in flat order: where it lies in the
  /// layout and the 1-D view the optimizer keys its state by (a per-rank checkpoint writes and
  /// reads each piece's state under it: distributed/zero/shard_checkpoint.hpp).
  template <class F>
  void for_each_piece(F&& f) const {
    for (const auto& piece : pieces_) f(piece.where, piece.view);
  }

  /// ZeRO-1: steps this rank's pieces with `optimizer`, their gradients slices of the parameters'
  /// whole (all-reduced) ones, then every owner broadcasts its pieces into the parameters. A
  /// collective: every rank calls it after the same reduction.
  void step(torch::optim::Optimizer& optimizer, ProcessGroup& group) {
    layout_->check_same_parameters(optimizer);
    torch::NoGradGuard no_grad;
    const std::vector<torch::Tensor>& distinct = layout_->distinct();
    std::vector<torch::Tensor> flat_grads(distinct.size());
    for (auto& piece : pieces_) {
      const torch::Tensor& grad = distinct[piece.where.distinct].grad();
      if (!grad.defined()) {
        piece.view.mutable_grad() = torch::Tensor();
        continue;
      }
      torch::Tensor& flat = flat_grads[piece.where.distinct];
      if (!flat.defined()) flat = detail::flat_in_layout_of(grad, distinct[piece.where.distinct]);
      piece.view.mutable_grad() = flat.narrow(0, piece.where.in_tensor, piece.where.length);
    }
    {
      PiecesAsGroups swapped(optimizer, *this);
      optimizer.step();
    }
    for (auto& piece : pieces_) piece.view.mutable_grad() = torch::Tensor();  // the gradients' storage is the model's
    broadcast_pieces(group);
  }

  /// Sharded gradients: points every piece's grad at its slice of its unit's reduced chunk in
  /// `unit_gradients` (none for a frozen parameter) and returns the pieces (what fp16's unscale
  /// and clipping see, and what step_pieces() steps).
  const std::vector<torch::Tensor>& pieces_with_gradients(const std::vector<torch::Tensor>& unit_gradients) {
    piece_views_.clear();
    for (auto& piece : pieces_) {
      // A frozen parameter has no gradient (as in plain DDP), so the optimizer leaves it alone.
      piece.view.mutable_grad() = layout_->distinct()[piece.where.distinct].requires_grad()
                                      ? unit_gradients[piece.where.unit].narrow(0, piece.where.in_chunk, piece.where.length)
                                      : torch::Tensor();
      piece_views_.push_back(piece.view);
    }
    return piece_views_;
  }
  /// Sharded gradients: steps this rank's pieces (their grads set by pieces_with_gradients()).
  void step_pieces(torch::optim::Optimizer& optimizer) {
    layout_->check_same_parameters(optimizer);
    torch::NoGradGuard no_grad;
    PiecesAsGroups swapped(optimizer, *this);
    optimizer.step();
  }

  /// After a whole state was loaded (a checkpoint, or an optimizer made before this fit): cuts
  /// this rank's pieces out of each parameter's state and erases the whole states.
  void keep_own_share(torch::optim::Optimizer& optimizer) const {
    layout_->check_same_parameters(optimizer);
    auto& state = optimizer.state();
    const std::vector<torch::Tensor>& distinct = layout_->distinct();
    for (size_t d = 0; d < distinct.size(); ++d) {
      auto whole = state.find(::trainloop::detail::optimizer_state_key(state, distinct[d]));
      if (whole == state.end()) continue;
      if (piece_of_[d] >= 0) {
        const OwnedPiece& piece = pieces_[static_cast<size_t>(piece_of_[d])];
        state[::trainloop::detail::optimizer_state_key(state, piece.view)] =
            detail::slice_state(*whole->second, distinct[d], piece.where.in_tensor, piece.where.length);
      }
      state.erase(::trainloop::detail::optimizer_state_key(state, distinct[d]));
    }
  }

  /// A collective: every rank sends the states of its pieces to `root`, which joins them into
  /// one state per parameter (on the CPU for other ranks' pieces), so that `root`'s optimizer
  /// holds the whole state in libtorch's layout until release_gathered(). Only `root` ever holds
  /// more than its share, and only until then.
  void gather_state(torch::optim::Optimizer& optimizer, ProcessGroup& group, int root) {
    layout_->check_same_parameters(optimizer);
    auto& state = optimizer.state();
    const std::vector<torch::Tensor>& distinct = layout_->distinct();
    const int world_size = layout_->world_size();
    torch::serialize::OutputArchive mine;
    if (rank_ != root) {
      for (const auto& piece : pieces_) {
        auto found = state.find(::trainloop::detail::optimizer_state_key(state, piece.view));
        if (found == state.end()) continue;
        torch::serialize::OutputArchive one;
        found->second->serialize(one);
        mine.write(std::to_string(piece.where.flat), one);
      }
    }
    std::ostringstream stream;
    if (rank_ != root) mine.save_to(stream);  // the root's own pieces stay where they are
    const std::string bytes = stream.str();
    torch::Tensor local = torch::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                                           torch::kUInt8);
    const std::vector<torch::Tensor> received = group.gather_rows_to(local, root);
    if (rank_ != root) return;
    // Every piece's state, by its flat start: the root's own (copied) and the others' (read).
    std::map<int64_t, std::unique_ptr<torch::optim::OptimizerParamState>> by_flat;
    for (const auto& piece : pieces_) {
      auto found = state.find(::trainloop::detail::optimizer_state_key(state, piece.view));
      if (found != state.end()) by_flat[piece.where.flat] = found->second->clone();
    }
    for (int r = 0; r < world_size; ++r) {
      if (r == root || received[static_cast<size_t>(r)].numel() == 0) continue;
      const torch::Tensor& from = received[static_cast<size_t>(r)];
      torch::serialize::InputArchive archive;
      archive.load_from(reinterpret_cast<const char*>(from.data_ptr<uint8_t>()), static_cast<size_t>(from.numel()),
                        torch::Device(torch::kCPU));
      for (const auto& key : archive.keys()) {
        torch::serialize::InputArchive one;
        archive.read(key, one);
        std::unique_ptr<torch::optim::OptimizerParamState> piece_state = detail::new_param_state(optimizer);
        piece_state->serialize(one);
        by_flat[std::stoll(key)] = std::move(piece_state);
      }
    }
    for (size_t d = 0; d < distinct.size(); ++d) {
      std::vector<const torch::optim::OptimizerParamState*> parts;
      for (auto it = by_flat.lower_bound(layout_->offset(d)); it != by_flat.end() && it->first < layout_->offset(d) + distinct[d].numel(); ++it) {
        parts.push_back(it->second.get());
      }
      if (parts.empty()) continue;  // never stepped (no gradient yet): no state, as in plain DDP
      state[::trainloop::detail::optimizer_state_key(state, distinct[d])] = detail::join_states(parts, distinct[d]);
      gathered_.push_back(d);
    }
  }

  /// Erases what gather_state() added on the root (a no-op elsewhere).
  void release_gathered(torch::optim::Optimizer& optimizer) noexcept {
    for (size_t d : gathered_) optimizer.state().erase(::trainloop::detail::optimizer_state_key(optimizer.state(), layout_->distinct()[d]));
    gathered_.clear();
  }

  /// After the step of ZeRO-1 and sharded gradients: every rank's range into every rank's
  /// parameters: each owner broadcasts its pieces, which are contiguous views of the parameters,
  /// so the values land in place (ProcessGroup::broadcast packs only the small ones into one
  /// buffer). Parameters that do not require grad are not sent (a frozen backbone). Measured
  /// against an all-gather of each rank's range through two staging buffers (4 Mi elements per
  /// round), 100 M-parameter MLP, Adam, 2 CPU ranks, pip torch 2.11: 0.957 s per step vs 0.754 s
  /// for the whole-tensor broadcasts of before; the copies in and out of the buffers were the
  /// difference (benchmarks/README.md, zero_memory).
  void broadcast_pieces(ProcessGroup& group) {
    const std::vector<torch::Tensor>& distinct = layout_->distinct();
    for (int r = 0; r < layout_->world_size(); ++r) {
      std::vector<torch::Tensor> views;
      for (size_t u = 0; u < layout_->unit_count(); ++u) {
        const auto [begin, end] = layout_->range_of(u, r);
        layout_->for_each_overlap(begin, end, [&](size_t d, int64_t in_tensor, int64_t, int64_t n) {
          if (distinct[d].requires_grad()) views.push_back(detail::flat_view(distinct[d]).narrow(0, in_tensor, n));
        });
      }
      if (!views.empty()) group.broadcast(views, r);
    }
  }

 private:
  /// One of this rank's pieces and the 1-D view the optimizer steps (of the parameter's storage,
  /// or of this rank's own chunk).
  struct OwnedPiece {
    FlatLayout::Piece where;
    torch::Tensor view;
  };

  /// The optimizer's param groups holding this rank's pieces instead of the parameters while it
  /// lives (a parameter listed twice gives its pieces twice, as the optimizer would step it twice).
  class PiecesAsGroups {
   public:
    PiecesAsGroups(torch::optim::Optimizer& optimizer, const ZeroOptimizerShard& shard) : optimizer_(optimizer) {
      saved_.reserve(optimizer_.param_groups().size());  // no allocation between swapping and saving
      size_t index = 0;
      for (auto& group : optimizer_.param_groups()) {
        std::vector<torch::Tensor> mine;
        for (size_t i = 0; i < group.params().size(); ++i, ++index) {
          const int64_t piece = shard.piece_of_[shard.layout_->distinct_of(index)];
          if (piece >= 0) mine.push_back(shard.pieces_[static_cast<size_t>(piece)].view);
        }
        saved_.push_back(std::move(group.params()));
        group.params() = std::move(mine);
      }
    }
    PiecesAsGroups(const PiecesAsGroups&) = delete;
    PiecesAsGroups& operator=(const PiecesAsGroups&) = delete;
    ~PiecesAsGroups() {
      auto& groups = optimizer_.param_groups();
      for (size_t g = 0; g < saved_.size(); ++g) groups[g].params() = std::move(saved_[g]);
    }

   private:
    torch::optim::Optimizer& optimizer_;
    std::vector<std::vector<torch::Tensor>> saved_;
  };

  std::shared_ptr<const FlatLayout> layout_;
  int rank_ = 0;
  std::vector<OwnedPiece> pieces_;          // this rank's range, in flat order
  std::vector<int64_t> piece_of_;           // pieces_ index of distinct parameter d's piece, -1 if none here
  std::vector<torch::Tensor> piece_views_;  // pieces_with_gradients()' answer
  std::vector<size_t> gathered_;            // distinct indices gather_state() added on the root
};

}  // namespace trainloop::distributed
