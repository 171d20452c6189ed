#pragma once
/// @file
/// @brief trainloop::distributed::ProcessGroup: rendezvous through a TCPStore, a Gloo or NCCL backend,
/// and the handful of collectives the loop needs (sum, max, broadcast, gather, barrier).
///
/// We hold the backend object (ProcessGroupGloo / ProcessGroupNCCL, a c10d::Backend) directly and
/// call its collectives, without the dispatching c10d::ProcessGroup wrapper we do not need (see
/// the c10d section of detail/torch_compat.hpp, and docs/status.md for what changes when
/// torchcomms replaces c10d's backends).
///
/// Every collective must be called in the same order with the same shapes on every rank; calls
/// from several threads of one rank must be serialised by the caller. The job's group (the
/// session's, rank_session.hpp) numbers and fingerprints each as it is issued
/// (progress/collective_log.hpp): the stall watchdog compares the ranks' calls, and a collective
/// that fails between ranks that called different ones throws DesyncError naming both calls
/// instead of the backend's words. (Other groups are not logged: their numbers would not match.)
///
/// How one collective is staged, logged, issued and waited for: collective_issuer.hpp; what a
/// failed one becomes: collective_failure.hpp; many tensors in flat buffers: flat_collectives.hpp;
/// bytes from one rank to another: point_to_point.hpp.

#include <trainloop/detail/padded_rows.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/backend_factory.hpp>
#include <trainloop/distributed/comm/collective_issuer.hpp>
#include <trainloop/distributed/comm/flat_collectives.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <cstdint>
#include <vector>

namespace trainloop::distributed {

/// Handle of an asynchronous collective; `ProcessGroup::wait(handle)` blocks until it is done.
using WorkHandle = ::trainloop::detail::WorkHandle;

/// A group of ranks that run collectives together. A small value class: copies share the same
/// underlying store and backend, which live as long as the last copy.
class ProcessGroup {
 public:
  /// An empty group; every collective on it throws. Assign the result of create() to it.
  ProcessGroup() = default;

  /// Connects to (or, on the store server, starts) the TCPStore at master_addr:master_port, then
  /// runs the backend's rendezvous with the other ranks. Blocks until all ranks have joined.
  /// @throws trainloop::Error naming master addr:port and the timeout when the store cannot be
  ///         reached in time, naming the port when the server cannot listen on it (in use), and
  ///         naming the backend when it is unavailable or its rendezvous fails.
  static ProcessGroup create(const ProcessGroupOptions& options) {
    validate(options);
    return create_over(connect_store(options), options);
  }

  /// As create(), over a connection to the job's store this process holds already (an elastic
  /// replacement asked to join through it: one connection, not two); its timeout becomes the options'.
  static ProcessGroup create_over(const c10::intrusive_ptr<::c10d::Store>& job_store, const ProcessGroupOptions& options) {
    validate(options);
    TRAINLOOP_CHECK(job_store, "create_over() without a store; expected a connection from connect_store()");
    ProcessGroup group;
    const Backend backend = resolve_backend(options);
    job_store->setTimeout(options.timeout);
    group.base_store_ = job_store;
    group.store_ = c10::make_intrusive<::c10d::PrefixStore>(options.store_prefix, group.base_store_);
    group.issuer_ = detail::CollectiveIssuer(options.rank, options.world_size, backend, options.device, options.timeout,
                                             make_backend(backend, options, group.store_));
    return group;
  }

  /// A new group over this group's store, with `options`' rank, world size, prefix (a fresh one:
  /// keys of this group must not be read) and timeout; the backend's rendezvous runs with the
  /// other ranks that call it. This group is left as it is (elastic training's survivors regroup
  /// while operations of the old group may still be blocked: distributed/elastic/regroup.hpp).
  ProcessGroup regroup(const ProcessGroupOptions& options) const {
    TRAINLOOP_CHECK(valid(), "regroup() of an empty process group; expected one made by create()");
    validate(options);
    ProcessGroup group;
    group.base_store_ = base_store_;
    group.store_ = c10::make_intrusive<::c10d::PrefixStore>(options.store_prefix, base_store_);
    group.issuer_ = detail::CollectiveIssuer(options.rank, options.world_size, backend(), options.device, options.timeout,
                                             make_backend(backend(), options, group.store_));
    return group;
  }

  /// This process's rank.
  int rank() const { return issuer_.rank(); }
  /// Number of ranks in the group.
  int world_size() const { return issuer_.world_size(); }
  /// The backend in use (never Auto).
  Backend backend() const { return issuer_.backend(); }
  /// Where collectives run: CPU for Gloo, the CUDA device for NCCL.
  torch::Device communication_device() const { return issuer_.communication_device(); }
  /// True once create() has filled this group.
  bool valid() const { return static_cast<bool>(issuer_.native()); }
  /// From now on this group's collectives go to the process's collective log (the job's group only).
  void log_collectives() { issuer_.log_collectives(); }
  /// The libtorch backend object, for collectives we do not wrap.
  const c10::intrusive_ptr<::trainloop::detail::CollectiveBackend>& native() const { return issuer_.native(); }
  /// The (prefixed) store, e.g. for small key/value exchanges.
  const c10::intrusive_ptr<::c10d::Store>& store() const { return store_; }
  /// The job's store without this group's prefix (shared by every group regroup() makes).
  const c10::intrusive_ptr<::c10d::Store>& job_store() const { return base_store_; }

  /// Sums `tensor` over all ranks, in place. Any device, layout or dtype the backend supports;
  /// non-contiguous or off-device tensors are staged through a temporary.
  void all_reduce_sum(const torch::Tensor& tensor) { all_reduce(tensor, ::c10d::ReduceOp::SUM, "all_reduce_sum"); }

  /// Sums each tensor over all ranks, in place; tensors of one dtype and device travel as one
  /// flat buffer (one collective per dtype/device group, not one per tensor).
  void all_reduce_sum(const std::vector<torch::Tensor>& tensors) {
    detail::for_each_flat_group(issuer_, tensors, [&](const torch::Tensor& flat) {
      std::vector<torch::Tensor> list{flat};
      return issuer_.native_checked()->allreduce(list, issuer_.allreduce_options(::c10d::ReduceOp::SUM));
    }, "all_reduce_sum", progress::CollectiveKind::AllReduceSum);
  }

  /// Starts summing `tensor` over all ranks in place and returns at once; pass the handle to
  /// wait() before reading `tensor`. The tensor must be contiguous and on communication_device()
  /// (nothing can be copied back for it later).
  WorkHandle all_reduce_sum_async(const torch::Tensor& tensor) {
    TRAINLOOP_CHECK(tensor.is_contiguous() && tensor.device() == communication_device(),
                    "all_reduce_sum_async needs a contiguous tensor on ", communication_device(),
                    "; got one on ", tensor.device(), tensor.is_contiguous() ? "" : " (non-contiguous)");
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> list{tensor};
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::AllReduceSum, tensor);
    return issuer_.launched(seq, "all_reduce_sum_async", [&] {
      return issuer_.native_checked()->allreduce(list, issuer_.allreduce_options(::c10d::ReduceOp::SUM));
    });
  }

  /// Element-wise maximum over all ranks, in place (e.g. "any rank wants to stop" flags).
  void all_reduce_max(const torch::Tensor& tensor) { all_reduce(tensor, ::c10d::ReduceOp::MAX, "all_reduce_max"); }

  /// Copies `root`'s values of each tensor into every rank's tensors (one flat buffer per
  /// dtype/device group). Shapes must already agree across ranks.
  void broadcast(const std::vector<torch::Tensor>& tensors, int root = 0) {
    issuer_.check_root(root);
    detail::for_each_flat_group(issuer_, tensors, [&](const torch::Tensor& flat) {
      std::vector<torch::Tensor> list{flat};
      ::c10d::BroadcastOptions options;
      options.rootRank = root;
      options.timeout = issuer_.timeout();
      return issuer_.native_checked()->broadcast(list, options);
    }, "broadcast", progress::CollectiveKind::Broadcast, root);
  }

  /// Single-tensor broadcast from `root`.
  void broadcast(const torch::Tensor& tensor, int root = 0) { broadcast(std::vector<torch::Tensor>{tensor}, root); }

  /// Gathers every rank's `tensor` (same shape and dtype on all ranks — keep it small and
  /// fixed-size, e.g. an int64 fingerprint) into a new tensor of shape [world_size, *shape] on
  /// `tensor`'s device; row r holds rank r's values.
  torch::Tensor all_gather(const torch::Tensor& tensor) {
    torch::NoGradGuard no_grad;
    torch::Tensor input = issuer_.staged(tensor);
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < issuer_.world_size(); ++r) outputs[0].push_back(torch::empty_like(input));
    std::vector<torch::Tensor> inputs{input};
    ::c10d::AllgatherOptions options;
    options.timeout = issuer_.timeout();
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::AllGather, input);
    wait(issuer_.launched(seq, "all_gather", [&] { return issuer_.native_checked()->allgather(outputs, inputs, options); }),
         "all_gather");
    return torch::stack(outputs[0]).to(tensor.device());
  }

  /// Gathers every rank's `tensor` (same shape and dtype on all ranks) on `root` only: element r
  /// of the result, on `root`, holds rank r's values (on the CPU); other ranks get an empty list.
  /// Unlike all_gather, only `root` ever holds world_size() copies (ZeRO's state for a checkpoint).
  std::vector<torch::Tensor> gather_to(const torch::Tensor& tensor, int root) {
    issuer_.check_root(root);
    torch::NoGradGuard no_grad;
    torch::Tensor input = issuer_.staged(tensor);
    std::vector<std::vector<torch::Tensor>> outputs;
    if (issuer_.rank() == root) {
      outputs.emplace_back();
      for (int r = 0; r < issuer_.world_size(); ++r) outputs[0].push_back(torch::empty_like(input));
    }
    std::vector<torch::Tensor> inputs{input};
    ::c10d::GatherOptions options;
    options.rootRank = root;
    options.timeout = issuer_.timeout();
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::Gather, input, root);
    wait(issuer_.launched(seq, "gather", [&] { return issuer_.native_checked()->gather(outputs, inputs, options); }),
         "gather");
    std::vector<torch::Tensor> rows;
    if (issuer_.rank() == root) {
      for (auto& row : outputs[0]) rows.push_back(row.to(torch::kCPU));
    }
    return rows;
  }

  /// Every rank's `local` (1-D, any length, the same dtype on every rank) on `root` only, cut to
  /// its length; an empty list on the other ranks. Lengths travel first (an all-gather of one
  /// number per rank), then the rows padded to the longest (gather_to).
  std::vector<torch::Tensor> gather_rows_to(const torch::Tensor& local, int root) {
    const torch::Tensor lengths = all_gather(torch::full({1}, local.numel(), torch::kInt64)).reshape({-1}).to(torch::kCPU);
    return ::trainloop::detail::cut_rows(gather_to(::trainloop::detail::pad_row(local, lengths.max().item<std::int64_t>()), root),
                                         lengths);
  }

  /// Sums `input` over all ranks and leaves this rank's share of the sum in `output`: `input`
  /// holds world_size() equal chunks of output.numel() elements, and rank r receives the sum of
  /// every rank's chunk r (a sharded optimizer's gradient step): the backend's own reduce-scatter
  /// (NCCL's, and Gloo's in every supported libtorch), (W-1)/W of the input on the wire per rank.
  void reduce_scatter_sum(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    issuer_.check_sharded_sizes(input, output, "reduce_scatter_sum");
    torch::Tensor flat_input = issuer_.staged(input).reshape({-1});
    torch::Tensor shard = issuer_.staged(output);
    if (issuer_.backend() == Backend::Gloo && detail::current_abandon_probe()) {
      // Elastic training: Gloo's reduce-scatter completes only inside its own wait(), which no
      // probe can abandon when a rank is lost; an all-reduce's wait can be (comm/abandonable_wait.hpp).
      // Twice the bytes on the wire; the same sums.
      torch::Tensor whole = flat_input.clone();
      all_reduce_sum(whole);
      output.copy_(whole.narrow(0, static_cast<std::int64_t>(issuer_.rank()) * shard.numel(), shard.numel()).view_as(output));
      return;
    }
    std::vector<std::vector<torch::Tensor>> inputs{std::vector<torch::Tensor>(flat_input.chunk(issuer_.world_size()))};
    std::vector<torch::Tensor> outputs{shard.reshape({-1})};
    ::c10d::ReduceScatterOptions options;
    options.reduceOp = ::c10d::ReduceOp::SUM;
    options.timeout = issuer_.timeout();
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::ReduceScatter, flat_input);
    wait(issuer_.launched(seq, "reduce_scatter",
                          [&] { return issuer_.native_checked()->reduce_scatter(outputs, inputs, options); }),
         "reduce_scatter");
    if (!shard.is_same(output)) output.copy_(shard);
  }

  /// Concatenates every rank's `input` (the same number of elements on every rank) in rank order
  /// into `output` (world_size() times as many): a sharded optimizer's parameter step. An
  /// allgather into views of `output`, which every backend has.
  void all_gather_into(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    issuer_.check_sharded_sizes(output, input, "all_gather_into");
    torch::Tensor gathered = issuer_.staged(output);
    wait(all_gather_into_async(issuer_.staged(input), gathered), "all_gather_into");
    if (gathered.data_ptr() != output.data_ptr()) output.copy_(gathered.view_as(output));  // it was staged
  }

  /// Starts all_gather_into() and returns at once; pass the handle to wait() before reading
  /// `output`. Both tensors must be contiguous and on communication_device() (nothing can be
  /// staged for them), and `output` must stay alive until then.
  WorkHandle all_gather_into_async(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    issuer_.check_sharded_sizes(output, input, "all_gather_into_async");
    TRAINLOOP_CHECK(input.is_contiguous() && output.is_contiguous() && input.device() == communication_device() &&
                        output.device() == communication_device(),
                    "all_gather_into_async needs contiguous tensors on ", communication_device(), "; got them on ",
                    input.device(), " and ", output.device());
    std::vector<std::vector<torch::Tensor>> outputs{
        std::vector<torch::Tensor>(output.reshape({-1}).chunk(issuer_.world_size()))};
    std::vector<torch::Tensor> inputs{input.reshape({-1})};
    ::c10d::AllgatherOptions options;
    options.timeout = issuer_.timeout();
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::AllGather, input);
    return issuer_.launched(seq, "all_gather_into",
                            [&] { return issuer_.native_checked()->allgather(outputs, inputs, options); });
  }

  /// Blocks until every rank has reached the barrier.
  void barrier() {
    ::c10d::BarrierOptions options;
    options.timeout = issuer_.timeout();
    if (issuer_.backend() == Backend::Nccl && issuer_.device().has_index()) {
      options.device_ids = {issuer_.device().index()};
    }
    const std::uint64_t seq = issuer_.log_call(progress::CollectiveKind::Barrier, torch::Tensor());
    wait(issuer_.launched(seq, "barrier", [&] { return issuer_.native_checked()->barrier(options); }), "barrier");
  }

  /// Waits for an asynchronous collective; a failure (peer died, timeout) becomes a
  /// trainloop::CommunicationError naming `what`, this rank and the timeout — or a
  /// trainloop::DesyncError naming both calls when the stall watchdog finds that the ranks called
  /// different collectives; running out of memory stays a c10::OutOfMemoryError (with that
  /// context added). While it blocks, the stall watchdog sees which collective it waits for.
  void wait(const WorkHandle& work, const char* what = "collective") const { issuer_.wait(work, what); }

  /// How this group's operations are logged, issued and waited for: for the point-to-point
  /// exchanges of point_to_point.hpp, which every rank calls as it calls a collective.
  detail::CollectiveIssuer& issuer() { return issuer_; }

 private:
  void all_reduce(const torch::Tensor& tensor, ::c10d::ReduceOp op, const char* what) {
    torch::NoGradGuard no_grad;
    torch::Tensor work_tensor = issuer_.staged(tensor);
    std::vector<torch::Tensor> list{work_tensor};
    const std::uint64_t seq = issuer_.log_call(
        op == ::c10d::ReduceOp::MAX ? progress::CollectiveKind::AllReduceMax : progress::CollectiveKind::AllReduceSum,
        work_tensor);
    wait(issuer_.launched(seq, what,
                          [&] { return issuer_.native_checked()->allreduce(list, issuer_.allreduce_options(op)); }),
         what);
    if (!work_tensor.is_same(tensor)) tensor.copy_(work_tensor);
  }

  detail::CollectiveIssuer issuer_;  // rank, world size, backend, device, timeout; issues and waits
  c10::intrusive_ptr<::c10d::Store> store_;
  c10::intrusive_ptr<::c10d::Store> base_store_;  // the job's store: TCPStore (its server on rank 0)
};

}  // namespace trainloop::distributed
