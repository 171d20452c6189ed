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
/// Levels 2 and 3 (DistributedDataParallel::sharding, distributed/zero/sharded_units.hpp) lay the
/// parameters out by *unit* (a submodule, FSDP's wrapped module): each unit is a flat range of its
/// own, cut in W equal chunks, so a unit's gradients can be reduce-scattered straight into the
/// owners' pieces. There each piece's gradient is a slice of its unit's reduced chunk
/// (unit_gradient), and at level 3 the pieces are views of this rank's own copy of its chunk
/// (PieceHome::OwnShard, the only copy of those values between steps).
///
/// Checkpoints hold the whole state in libtorch's layout, one state per parameter (gather_state()
/// joins the pieces on the writing rank), so a ZeRO checkpoint resumes in plain DDP, single, dp,
/// or ZeRO with another world size; loading any checkpoint loads the whole state and
/// keep_own_share() cuts this rank's pieces out of it.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/detail/type_name.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
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

/// @brief This rank's exact share of the flat parameter space, and the four collectives of
/// ZeRO-1: step, gather of the whole state (for a checkpoint), release, and keeping one's share.
class ZeroOptimizerShard {
 public:
  /// @throws trainloop::ConfigurationError when `optimizer` cannot step a piece of a tensor.
  static void check_optimizer(const torch::optim::Optimizer& optimizer) {
    // LBFGS keeps one state for all parameters (its history of directions), keyed by the first
    // parameter: sharding it would split what cannot be split.
    if (dynamic_cast<const torch::optim::LBFGS*>(&optimizer) != nullptr) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer LBFGS, whose state is one history for all "
                               "parameters, not per parameter; expected an optimizer with state per parameter "
                               "(SGD, Adam, AdamW, Adagrad, RMSprop) or zero off");
    }
    // A user's optimizer may compute per-tensor quantities (LAMB's and LARS's trust ratios use the
    // norm of the whole tensor): stepping a piece would change its result without a word.
    if (!detail::steps_per_element(optimizer)) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer " + ::trainloop::detail::demangled(typeid(optimizer).name()) +
                               ", which trainloop cannot prove updates each element on its own (ZeRO steps pieces "
                               "of tensors); expected SGD, Adam, AdamW, Adagrad or RMSprop, or zero off");
    }
  }

  /// Where a rank's pieces live: in the parameters (levels 1 and 2), or in a chunk of its own
  /// per unit that the parameters are gathered from (level 3).
  enum class PieceHome { Parameters, OwnShard };

  /// Lays out every parameter of `optimizer` (its param groups in order) and cuts this rank's range.
  /// `unit_of` (TensorImpl address to unit index) groups them in units, each cut separately;
  /// empty: one unit, the whole flat space (level 1).
  ZeroOptimizerShard(const torch::optim::Optimizer& optimizer, int rank, int world_size,
                     const std::unordered_map<const void*, int>& unit_of = {}, PieceHome home = PieceHome::Parameters)
      : rank_(rank), world_size_(world_size), home_(home) {
    check_optimizer(optimizer);
    std::unordered_map<const void*, size_t> distinct_index;
    for (const auto& group : optimizer.param_groups()) {
      for (const auto& parameter : group.params()) {
        auto [found, added] = distinct_index.emplace(parameter.unsafeGetTensorImpl(), distinct_.size());
        if (added) {
          TRAINLOOP_CHECK(distinct_.empty() || (parameter.scalar_type() == distinct_.front().scalar_type() &&
                                                parameter.device() == distinct_.front().device()),
                          "ZeRO's flat shards need every parameter in one dtype on one device; parameter ",
                          distinct_.size(), " is ", parameter.scalar_type(), " on ", parameter.device(), ", the first ",
                          distinct_.front().scalar_type(), " on ", distinct_.front().device());
          distinct_.push_back(parameter);
        }
        parameters_.push_back(parameter);
        distinct_of_.push_back(found->second);
      }
    }
    lay_out_units(unit_of);
    piece_of_.assign(distinct_.size(), -1);  // a unit's range is contiguous: at most one piece per tensor
    for (size_t u = 0; u < units_.size(); ++u) {
      const auto [begin, end] = range_of(u, rank_);
      if (home_ == PieceHome::OwnShard) own_shards_.push_back(distinct_.empty() ? torch::Tensor() :
                                                             torch::zeros({units_[u].chunk}, distinct_.front().options()));
      for_each_overlap(begin, end, [&](size_t d, int64_t in_tensor, int64_t flat, int64_t length) {
        piece_of_[d] = static_cast<int64_t>(pieces_.size());
        torch::Tensor view = home_ == PieceHome::OwnShard ? own_shards_[u].narrow(0, flat - begin, length)
                                                          : detail::flat_view(distinct_[d]).narrow(0, in_tensor, length);
        pieces_.push_back(Piece{d, u, in_tensor, length, flat, flat - begin, std::move(view)});
      });
    }
    if (home_ == PieceHome::OwnShard) refresh_own_shards();
  }

  /// Elements of the flat space rank `r` owns (its share of the optimizer state).
  int64_t owned_elements(int r) const {
    int64_t owned = 0;
    for (size_t u = 0; u < units_.size(); ++u) {
      const auto [begin, end] = range_of(u, r);
      owned += end - begin;
    }
    return owned;
  }
  /// How many pieces of tensors this rank owns (a tensor split at a range's end counts on both ranks).
  size_t piece_count() const { return pieces_.size(); }

  // ---- the layout by unit, for levels 2 and 3 (distributed/zero/sharded_units.hpp) ----
  /// Units in the layout (1 at level 1).
  size_t unit_count() const { return units_.size(); }
  /// Elements of unit `u` (its tensors end to end, without padding).
  int64_t unit_length(size_t u) const { return units_[u].length; }
  /// Elements of each rank's chunk of unit `u`: ceil(unit_length / W); the last chunks are padded.
  int64_t unit_chunk(size_t u) const { return units_[u].chunk; }
  /// The parameters of unit `u` (distinct tensors, in layout order) and where each starts in it.
  std::vector<std::pair<torch::Tensor, int64_t>> unit_tensors(size_t u) const {
    std::vector<std::pair<torch::Tensor, int64_t>> tensors;
    for (size_t d : units_[u].members) tensors.emplace_back(distinct_[d], offsets_[d] - units_[u].begin);
    return tensors;
  }
  /// Level 3: this rank's chunk of unit `u`, the values its pieces step (padding zero).
  const torch::Tensor& own_shard(size_t u) const { return own_shards_.at(u); }
  /// Level 3: copies this rank's chunk of every unit from the parameters' current values (after
  /// they were whole on every rank: a loaded checkpoint, or gathered for evaluation).
  void refresh_own_shards() {
    torch::NoGradGuard no_grad;
    for (const auto& piece : pieces_) {
      own_shards_[piece.unit].narrow(0, piece.in_chunk, piece.length)
          .copy_(detail::flat_view(distinct_[piece.distinct]).narrow(0, piece.in_tensor, piece.length));
    }
  }
  /// Levels 2 and 3: the buffer rank's reduced chunk of unit `u`'s gradient lands in (zeros until
  /// the first reduction).
  torch::Tensor& unit_gradient(size_t u) {
    if (unit_gradients_.empty()) {
      for (const auto& unit : units_) unit_gradients_.push_back(torch::zeros({unit.chunk}, distinct_.front().options()));
    }
    return unit_gradients_[u];
  }
  /// Levels 2 and 3: points every piece's grad at its slice of its unit's reduced chunk (none for
  /// a frozen parameter) and returns the pieces (what fp16's unscale and clipping see).
  const std::vector<torch::Tensor>& pieces_with_unit_gradients() {
    piece_views_.clear();
    for (auto& piece : pieces_) {
      // A frozen parameter has no gradient (as in plain DDP), so the optimizer leaves it alone.
      piece.view.mutable_grad() = distinct_[piece.distinct].requires_grad()
                                      ? unit_gradient(piece.unit).narrow(0, piece.in_chunk, piece.length)
                                      : torch::Tensor();
      piece_views_.push_back(piece.view);
    }
    return piece_views_;
  }
  /// Levels 2 and 3: steps this rank's pieces (their grads set by pieces_with_unit_gradients()).
  void step_pieces(torch::optim::Optimizer& optimizer) {
    check_same_parameters(optimizer);
    torch::NoGradGuard no_grad;
    PiecesAsGroups swapped(optimizer, *this);
    optimizer.step();
  }

  /// Whether `optimizer` holds the parameters the layout was made for, in the same order.
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

  /// Steps this rank's pieces with `optimizer`, then every owner broadcasts its pieces into the
  /// parameters. A collective: every rank calls it after the same reduction.
  void step(torch::optim::Optimizer& optimizer, ProcessGroup& group) {
    check_same_parameters(optimizer);
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> flat_grads(distinct_.size());
    for (auto& piece : pieces_) {
      const torch::Tensor& grad = distinct_[piece.distinct].grad();
      if (!grad.defined()) {
        piece.view.mutable_grad() = torch::Tensor();
        continue;
      }
      torch::Tensor& flat = flat_grads[piece.distinct];
      if (!flat.defined()) flat = detail::flat_in_layout_of(grad, distinct_[piece.distinct]);
      piece.view.mutable_grad() = flat.narrow(0, piece.in_tensor, piece.length);
    }
    {
      PiecesAsGroups swapped(optimizer, *this);
      optimizer.step();
    }
    for (auto& piece : pieces_) piece.view.mutable_grad() = torch::Tensor();  // the gradients' storage is the model's
    broadcast_pieces(group);
  }

  /// After a whole state was loaded (a checkpoint, or an optimizer made before this fit): cuts
  /// this rank's pieces out of each parameter's state and erases the whole states.
  void keep_own_share(torch::optim::Optimizer& optimizer) const {
    check_same_parameters(optimizer);
    auto& state = optimizer.state();
    for (size_t d = 0; d < distinct_.size(); ++d) {
      auto whole = state.find(::trainloop::detail::optimizer_state_key(state, distinct_[d]));
      if (whole == state.end()) continue;
      if (piece_of_[d] >= 0) {
        const Piece& piece = pieces_[static_cast<size_t>(piece_of_[d])];
        state[::trainloop::detail::optimizer_state_key(state, piece.view)] =
            detail::slice_state(*whole->second, distinct_[d], piece.in_tensor, piece.length);
      }
      state.erase(::trainloop::detail::optimizer_state_key(state, distinct_[d]));
    }
  }

  /// A collective: every rank sends the states of its pieces to `root`, which joins them into
  /// one state per parameter (on the CPU for other ranks' pieces), so that `root`'s optimizer
  /// holds the whole state in libtorch's layout until release_gathered(). Only `root` ever holds
  /// more than its share, and only until then.
  void gather_state(torch::optim::Optimizer& optimizer, ProcessGroup& group, int root) {
    check_same_parameters(optimizer);
    auto& state = optimizer.state();
    torch::serialize::OutputArchive mine;
    if (rank_ != root) {
      for (const auto& piece : pieces_) {
        auto found = state.find(::trainloop::detail::optimizer_state_key(state, piece.view));
        if (found == state.end()) continue;
        torch::serialize::OutputArchive one;
        found->second->serialize(one);
        mine.write(std::to_string(piece.flat), one);
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
      if (found != state.end()) by_flat[piece.flat] = found->second->clone();
    }
    for (int r = 0; r < world_size_; ++r) {
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
    for (size_t d = 0; d < distinct_.size(); ++d) {
      std::vector<const torch::optim::OptimizerParamState*> parts;
      for (auto it = by_flat.lower_bound(offsets_[d]); it != by_flat.end() && it->first < offsets_[d] + distinct_[d].numel(); ++it) {
        parts.push_back(it->second.get());
      }
      if (parts.empty()) continue;  // never stepped (no gradient yet): no state, as in plain DDP
      state[::trainloop::detail::optimizer_state_key(state, distinct_[d])] = detail::join_states(parts, distinct_[d]);
      gathered_.push_back(d);
    }
  }

  /// Erases what gather_state() added on the root (a no-op elsewhere).
  void release_gathered(torch::optim::Optimizer& optimizer) noexcept {
    for (size_t d : gathered_) optimizer.state().erase(::trainloop::detail::optimizer_state_key(optimizer.state(), distinct_[d]));
    gathered_.clear();
  }

 private:
  /// A contiguous part of one parameter in this rank's range.
  struct Piece {
    size_t distinct = 0;     ///< which parameter (distinct_ index)
    size_t unit = 0;         ///< which unit it belongs to
    int64_t in_tensor = 0;   ///< first element, in the parameter's memory order
    int64_t length = 0;      ///< elements
    int64_t flat = 0;        ///< first element in the flat index space
    int64_t in_chunk = 0;    ///< first element in this rank's chunk of its unit
    torch::Tensor view;      ///< 1-D view of the parameter's storage (or of own_shard): what the optimizer steps
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
          const int64_t piece = shard.piece_of_[shard.distinct_of_[index]];
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

  /// Calls f(distinct, first element in it, flat start, length) for each parameter overlapping
  /// the flat range [begin, end).
  template <class F>
  void for_each_overlap(int64_t begin, int64_t end, F&& f) const {
    for (size_t d = 0; d < distinct_.size(); ++d) {
      const int64_t lo = std::max(begin, offsets_[d]), hi = std::min(end, offsets_[d] + distinct_[d].numel());
      if (lo < hi) f(d, lo - offsets_[d], lo, hi - lo);
    }
  }

  /// Groups the distinct tensors in units (all in unit 0 when `unit_of` is empty), in unit order
  /// and each unit's tensors in first-listed order, and places them in the flat space.
  void lay_out_units(const std::unordered_map<const void*, int>& unit_of) {
    int count = 1;
    std::vector<int> unit_index(distinct_.size(), 0);
    for (size_t d = 0; d < distinct_.size() && !unit_of.empty(); ++d) {
      auto found = unit_of.find(distinct_[d].unsafeGetTensorImpl());
      TRAINLOOP_CHECK(found != unit_of.end(), "parameter ", d, " of the optimizer (sizes ", distinct_[d].sizes(),
                      ") is in no unit of the model; expected the optimizer to hold only the model's parameters");
      unit_index[d] = found->second;
      count = std::max(count, found->second + 1);
    }
    units_.assign(static_cast<size_t>(count), Unit{});
    offsets_.assign(distinct_.size(), 0);
    for (size_t u = 0; u < units_.size(); ++u) {
      units_[u].begin = total_;
      for (size_t d = 0; d < distinct_.size(); ++d) {
        if (unit_index[d] != static_cast<int>(u)) continue;
        offsets_[d] = total_;
        total_ += distinct_[d].numel();
        units_[u].members.push_back(d);
      }
      units_[u].length = total_ - units_[u].begin;
      units_[u].chunk = (units_[u].length + world_size_ - 1) / std::max(world_size_, 1);
    }
  }

  /// Rank `r`'s range of unit `u` in the flat space: [begin, end).
  std::pair<int64_t, int64_t> range_of(size_t u, int r) const {
    const Unit& unit = units_[u];
    const int64_t begin = unit.begin + std::min(unit.length, static_cast<int64_t>(r) * unit.chunk);
    return {begin, std::min(unit.begin + unit.length, begin + unit.chunk)};
  }

  /// Levels 1 and 2, after the step: every rank's range into every rank's parameters: each owner broadcasts its pieces, which are
  /// contiguous views of the parameters, so the values land in place (ProcessGroup::broadcast
  /// packs only the small ones into one buffer). Parameters that do not require grad are not sent
  /// (a frozen backbone). Measured against an all-gather of each rank's range through two staging
  /// buffers (4 Mi elements per round), 100 M-parameter MLP, Adam, 2 CPU ranks, pip torch 2.11:
  /// 0.957 s per step vs 0.754 s for the whole-tensor broadcasts of before; the copies in and out
  /// of the buffers were the difference (benchmarks/README.md, zero_memory).
 public:
  void broadcast_pieces(ProcessGroup& group) {
    for (int r = 0; r < world_size_; ++r) {
      std::vector<torch::Tensor> views;
      for (size_t u = 0; u < units_.size(); ++u) {
        const auto [begin, end] = range_of(u, r);
        for_each_overlap(begin, end, [&](size_t d, int64_t in_tensor, int64_t, int64_t n) {
          if (distinct_[d].requires_grad()) views.push_back(detail::flat_view(distinct_[d]).narrow(0, in_tensor, n));
        });
      }
      if (!views.empty()) group.broadcast(views, r);
    }
  }
 private:


  /// The optimizer must still hold the parameters the layout was made for.
  void check_same_parameters(const torch::optim::Optimizer& optimizer) const {
    TRAINLOOP_CHECK(same_parameters(optimizer), "the optimizer's parameters changed since ZeRO laid them out (",
                    parameters_.size(), " then); expected the parameter groups the fit began with");
  }

  int rank_ = 0;
  int world_size_ = 1;
  std::vector<torch::Tensor> parameters_;  // param groups in order, a tied tensor as often as listed
  std::vector<size_t> distinct_of_;        // parameters_[i] is distinct_[distinct_of_[i]]
  std::vector<torch::Tensor> distinct_;    // each tensor once, in first-listed order
  std::vector<int64_t> offsets_;           // distinct_[d] starts at offsets_[d] in the flat space
  int64_t total_ = 0;                      // elements of all distinct tensors
  struct Unit {
    int64_t begin = 0, length = 0, chunk = 0;  // flat start, elements, elements per rank: ceil(length / W)
    std::vector<size_t> members;               // distinct indices, in layout order
  };
  std::vector<Unit> units_;                // the flat space, unit after unit
  PieceHome home_ = PieceHome::Parameters;
  std::vector<torch::Tensor> own_shards_;      // level 3: this rank's chunk of each unit
  std::vector<torch::Tensor> unit_gradients_;  // levels 2 and 3: this rank's reduced chunk of each unit's gradient
  std::vector<torch::Tensor> piece_views_;     // pieces_with_unit_gradients()' answer
  std::vector<Piece> pieces_;              // this rank's range, in flat order
  std::vector<int64_t> piece_of_;          // pieces_ index of distinct_[d]'s piece, -1 if none here
  std::vector<size_t> gathered_;           // distinct indices gather_state() added on the root
};

}  // namespace trainloop::distributed
