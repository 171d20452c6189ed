#pragma once
/// @file
/// @brief A sharded rank's part of a per-rank checkpoint: its pieces of the flat layout
/// (distributed/zero/flat_layout.hpp) as TensorShares — the parameters' values and their optimizer
/// state — and the reading of exactly those pieces back, whatever world size wrote the checkpoint.
///
/// A piece is a contiguous run of one parameter in its memory order: row-major for a contiguous
/// parameter; for one in another order (channels_last) the share says which (TensorShare::
/// memory_order) and is written as the boxes it covers. Reading such a parameter's piece of the
/// state reads the whole field once (the tensor, then the piece cut from it in memory order).

#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/distributed/zero/flat_layout.hpp>
#include <trainloop/distributed/zero/piece_states.hpp>
#include <trainloop/distributed/zero/zero_optimizer_shard.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/error.hpp>
#include <trainloop/optim/param_state_fields.hpp>

#include <torch/torch.h>

#include <string>
#include <unordered_map>
#include <vector>

namespace trainloop::distributed {

namespace detail {
/// The checkpoint key of layout parameter `parameter` (`model.<name>`).
inline const std::string& share_key_of(const std::unordered_map<const void*, std::string>& keys,
                                       const torch::Tensor& parameter) {
  auto found = keys.find(parameter.unsafeGetTensorImpl());
  TRAINLOOP_CHECK(found != keys.end(), "a parameter the optimizer steps (sizes ", parameter.sizes(), ") is not one of "
                  "the model's; expected the optimizer to hold only the model's parameters");
  return found->second;
}
}  // namespace detail

/// This rank's shares: for each of its pieces, the parameter's values there and the piece's
/// optimizer state (each per-element field; the step counter once per parameter, by the rank
/// owning its first element). `values_from_pieces`: the pieces hold the parameters' values (full
/// sharding inside a fit, where the parameters are freed between uses); otherwise the values are
/// read from the parameters themselves (they are whole). No copy: the shares are views.
inline std::vector<TensorShare> zero_checkpoint_shares(const ZeroOptimizerShard& shard, const torch::nn::Module& module,
                                                       torch::optim::Optimizer& optimizer, bool values_from_pieces) {
  const auto keys = parameter_keys(module);
  const std::vector<torch::Tensor>& distinct = shard.layout().distinct();
  auto& state = optimizer.state();
  std::vector<TensorShare> shares;
  shard.for_each_piece([&](const FlatLayout::Piece& where, const torch::Tensor& view) {
    const torch::Tensor& parameter = distinct[where.distinct];
    const std::string& key = detail::share_key_of(keys, parameter);
    const std::vector<int64_t> size = parameter.sizes().vec();
    const std::vector<int64_t> order = memory_order_of(parameter);
    torch::Tensor values = values_from_pieces ? view.detach() : detail::flat_view(parameter).narrow(0, where.in_tensor, where.length);
    shares.push_back({key, size, where.in_tensor, values, order});
    auto found = state.find(::trainloop::detail::optimizer_state_key(state, view));
    if (found == state.end()) return;  // never stepped: no state, as in one process
    for (auto& [field, tensor] : optim::named_elementwise_fields(*found->second)) {
      if (tensor->defined()) shares.push_back({state_share_key(key, field), size, where.in_tensor, tensor->reshape({-1}), order});
    }
    if (const auto step = optim::state_step(*found->second); step && where.in_tensor == 0) {
      shares.push_back({state_share_key(key, "step"), {}, 0, torch::full({1}, static_cast<double>(*step), torch::kFloat64)});
    }
  });
  return shares;
}

/// Reads this rank's pieces of the optimizer state from `source` (only their element ranges) into
/// `optimizer`'s state, keyed by the pieces as the step expects. A parameter without state in the
/// checkpoint (never stepped) gets none.
inline void load_zero_optimizer_shares(const ZeroOptimizerShard& shard, const torch::nn::Module& module,
                                       torch::optim::Optimizer& optimizer, ShareSource& source) {
  const auto keys = parameter_keys(module);
  const std::vector<torch::Tensor>& distinct = shard.layout().distinct();
  auto& state = optimizer.state();
  shard.for_each_piece([&](const FlatLayout::Piece& where, const torch::Tensor& view) {
    const torch::Tensor& parameter = distinct[where.distinct];
    const std::string& key = detail::share_key_of(keys, parameter);
    std::unique_ptr<torch::optim::OptimizerParamState> piece_state = optim::new_param_state(optimizer);
    bool any = false;
    for (auto& [field, tensor] : optim::named_elementwise_fields(*piece_state)) {
      const std::string field_key = state_share_key(key, field);
      if (!source.has(field_key)) continue;
      if (parameter.is_contiguous()) {
        *tensor = source.read_range(field_key, where.in_tensor, where.in_tensor + where.length).to(view.device());
      } else {  // the piece is a run in the parameter's memory order: cut from the whole field
        *tensor = detail::flat_in_layout_of(source.read_whole(field_key), parameter).narrow(0, where.in_tensor, where.length)
                      .clone().to(view.device());
      }
      any = true;
    }
    if (!any) return;
    if (const std::string step_key = state_share_key(key, "step"); source.has(step_key)) {
      optim::set_state_step(*piece_state, static_cast<int64_t>(source.read_whole(step_key).item<double>()));
    }
    state[::trainloop::detail::optimizer_state_key(state, view)] = std::move(piece_state);
  });
}

}  // namespace trainloop::distributed
