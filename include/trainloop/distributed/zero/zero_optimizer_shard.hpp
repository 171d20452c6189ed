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
/// Checkpoints hold the whole state in libtorch's layout, one state per parameter (gather_state()
/// joins the pieces on the writing rank), so a ZeRO checkpoint resumes in plain DDP, single, dp,
/// or ZeRO with another world size; loading any checkpoint loads the whole state and
/// keep_own_share() cuts this rank's pieces out of it.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/detail/type_name.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
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
    if (!steps_per_element(optimizer)) {
      throw ConfigurationError("trainloop: ZeRO is on with optimizer " + ::trainloop::detail::demangled(typeid(optimizer).name()) +
                               ", which trainloop cannot prove updates each element on its own (ZeRO steps pieces "
                               "of tensors); expected SGD, Adam, AdamW, Adagrad or RMSprop, or zero off");
    }
  }

  /// Lays out every parameter of `optimizer` (its param groups in order) and cuts this rank's range.
  ZeroOptimizerShard(const torch::optim::Optimizer& optimizer, int rank, int world_size)
      : rank_(rank), world_size_(world_size) {
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
          offsets_.push_back(total_);
          total_ += parameter.numel();
          distinct_.push_back(parameter);
        }
        parameters_.push_back(parameter);
        distinct_of_.push_back(found->second);
      }
    }
    chunk_ = (total_ + world_size_ - 1) / std::max(world_size_, 1);
    const int64_t begin = rank_ * chunk_, end = std::min(total_, begin + chunk_);
    piece_of_.assign(distinct_.size(), -1);  // a range is contiguous: at most one piece per tensor
    for_each_overlap(begin, end, [&](size_t d, int64_t in_tensor, int64_t flat, int64_t length) {
      piece_of_[d] = static_cast<int64_t>(pieces_.size());
      pieces_.push_back(Piece{d, in_tensor, length, flat, flat_view(distinct_[d]).narrow(0, in_tensor, length)});
    });
  }

  /// Elements of the flat range rank `r` owns (its share of the optimizer state).
  int64_t owned_elements(int r) const {
    const int64_t begin = std::min(total_, static_cast<int64_t>(r) * chunk_);
    return std::min(total_, begin + chunk_) - begin;
  }
  /// How many pieces of tensors this rank owns (a tensor split at a range's end counts on both ranks).
  size_t piece_count() const { return pieces_.size(); }

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
      if (!flat.defined()) flat = flat_in_layout_of(grad, distinct_[piece.distinct]);
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
        state[::trainloop::detail::optimizer_state_key(state, piece.view)] = slice_state(*whole->second, piece);
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
        std::unique_ptr<torch::optim::OptimizerParamState> piece_state = new_param_state(optimizer);
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
      state[::trainloop::detail::optimizer_state_key(state, distinct_[d])] = join_states(parts, distinct_[d]);
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
    int64_t in_tensor = 0;   ///< first element, in the parameter's memory order
    int64_t length = 0;      ///< elements
    int64_t flat = 0;        ///< first element in the flat index space
    torch::Tensor view;      ///< 1-D view of the parameter's storage: what the optimizer steps
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

  /// `tensor`'s elements as a 1-D view in memory order (its storage, without autograd).
  static torch::Tensor flat_view(const torch::Tensor& tensor) {
    TRAINLOOP_CHECK(tensor.is_non_overlapping_and_dense(), "ZeRO needs parameters whose elements are one dense "
                    "block of memory; a parameter of sizes ", tensor.sizes(), " has strides ", tensor.strides());
    return tensor.detach().as_strided({tensor.numel()}, {1}, tensor.storage_offset());
  }

  /// `tensor` (a gradient or a state of `parameter`) flat in the parameter's memory order: a view
  /// when it has the parameter's strides, a copy in them otherwise.
  static torch::Tensor flat_in_layout_of(const torch::Tensor& tensor, const torch::Tensor& parameter) {
    if (tensor.strides() == parameter.strides() && tensor.is_non_overlapping_and_dense()) return flat_view(tensor);
    return flat_view(torch::empty_like(parameter).copy_(tensor));
  }

  /// The state tensors of `state` that hold one value per element of their parameter.
  static std::vector<torch::Tensor*> elementwise_fields(torch::optim::OptimizerParamState& state) {
    namespace optim = torch::optim;
    if (auto* adamw = dynamic_cast<optim::AdamWParamState*>(&state)) {
      return {&adamw->exp_avg(), &adamw->exp_avg_sq(), &adamw->max_exp_avg_sq()};
    }
    if (auto* adam = dynamic_cast<optim::AdamParamState*>(&state)) {
      return {&adam->exp_avg(), &adam->exp_avg_sq(), &adam->max_exp_avg_sq()};
    }
    if (auto* sgd = dynamic_cast<optim::SGDParamState*>(&state)) return {&sgd->momentum_buffer()};
    if (auto* adagrad = dynamic_cast<optim::AdagradParamState*>(&state)) return {&adagrad->sum()};
    if (auto* rmsprop = dynamic_cast<optim::RMSpropParamState*>(&state)) {
      return {&rmsprop->square_avg(), &rmsprop->momentum_buffer(), &rmsprop->grad_avg()};
    }
    return {};
  }

  /// Whether `optimizer` is one whose update is per element (its state fields are known above).
  static bool steps_per_element(const torch::optim::Optimizer& optimizer) {
    namespace optim = torch::optim;
    return dynamic_cast<const optim::SGD*>(&optimizer) || dynamic_cast<const optim::Adam*>(&optimizer) ||
           dynamic_cast<const optim::AdamW*>(&optimizer) || dynamic_cast<const optim::Adagrad*>(&optimizer) ||
           dynamic_cast<const optim::RMSprop*>(&optimizer);
  }

  /// The state of one piece, cut from its parameter's whole state (counters copied).
  std::unique_ptr<torch::optim::OptimizerParamState> slice_state(const torch::optim::OptimizerParamState& whole,
                                                                  const Piece& piece) const {
    std::unique_ptr<torch::optim::OptimizerParamState> part = whole.clone();
    const torch::Tensor& parameter = distinct_[piece.distinct];
    for (torch::Tensor* field : elementwise_fields(*part)) {
      if (field->defined()) {
        *field = flat_in_layout_of(field->to(parameter.device()), parameter).narrow(0, piece.in_tensor, piece.length).clone();
      }
    }
    return part;
  }

  /// One parameter's whole state from its pieces' states, in flat order (counters from the first).
  static std::unique_ptr<torch::optim::OptimizerParamState> join_states(
      const std::vector<const torch::optim::OptimizerParamState*>& parts, const torch::Tensor& parameter) {
    std::unique_ptr<torch::optim::OptimizerParamState> whole = parts.front()->clone();
    std::vector<torch::Tensor*> fields = elementwise_fields(*whole);
    for (size_t f = 0; f < fields.size(); ++f) {
      if (!fields[f]->defined()) continue;
      std::vector<torch::Tensor> flat;
      for (const auto* part : parts) {
        std::unique_ptr<torch::optim::OptimizerParamState> copy = part->clone();
        flat.push_back(elementwise_fields(*copy)[f]->to(torch::kCPU).reshape({-1}));
      }
      torch::Tensor joined = torch::empty_like(parameter, torch::TensorOptions().device(torch::kCPU));
      flat_view(joined).copy_(torch::cat(flat));
      *fields[f] = joined;
    }
    return whole;
  }

  /// Every rank's range into every rank's parameters: each owner broadcasts its pieces, which are
  /// contiguous views of the parameters, so the values land in place (ProcessGroup::broadcast
  /// packs only the small ones into one buffer). Parameters that do not require grad are not sent
  /// (a frozen backbone). Measured against an all-gather of each rank's range through two staging
  /// buffers (4 Mi elements per round), 100 M-parameter MLP, Adam, 2 CPU ranks, pip torch 2.11:
  /// 0.957 s per step vs 0.754 s for the whole-tensor broadcasts of before; the copies in and out
  /// of the buffers were the difference (benchmarks/README.md, zero_memory).
  void broadcast_pieces(ProcessGroup& group) {
    for (int r = 0; r < world_size_; ++r) {
      std::vector<torch::Tensor> views;
      const int64_t begin = std::min(total_, static_cast<int64_t>(r) * chunk_);
      for_each_overlap(begin, std::min(total_, begin + chunk_), [&](size_t d, int64_t in_tensor, int64_t, int64_t n) {
        if (distinct_[d].requires_grad()) views.push_back(flat_view(distinct_[d]).narrow(0, in_tensor, n));
      });
      if (!views.empty()) group.broadcast(views, r);
    }
  }

  /// A parameter state of `optimizer`'s type, for the root to deserialize another rank's into.
  static std::unique_ptr<torch::optim::OptimizerParamState> new_param_state(const torch::optim::Optimizer& optimizer) {
    namespace optim = torch::optim;
    if (dynamic_cast<const optim::AdamW*>(&optimizer)) return std::make_unique<optim::AdamWParamState>();
    if (dynamic_cast<const optim::Adam*>(&optimizer)) return std::make_unique<optim::AdamParamState>();
    if (dynamic_cast<const optim::SGD*>(&optimizer)) return std::make_unique<optim::SGDParamState>();
    if (dynamic_cast<const optim::Adagrad*>(&optimizer)) return std::make_unique<optim::AdagradParamState>();
    return std::make_unique<optim::RMSpropParamState>();  // check_optimizer() admits no other
  }

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
  int64_t chunk_ = 0;                      // elements per rank's range: ceil(total_ / world_size_)
  std::vector<Piece> pieces_;              // this rank's range, in flat order
  std::vector<int64_t> piece_of_;          // pieces_ index of distinct_[d]'s piece, -1 if none here
  std::vector<size_t> gathered_;           // distinct indices gather_state() added on the root
};

}  // namespace trainloop::distributed
