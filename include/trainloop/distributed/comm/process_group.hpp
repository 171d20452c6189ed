#pragma once
/// @file
/// @brief trainloop::distributed::ProcessGroup: rendezvous through a TCPStore, a Gloo or NCCL backend,
/// and the handful of collectives the loop needs (sum, max, broadcast, gather, barrier).
///
/// We hold the backend object (ProcessGroupGloo / ProcessGroupNCCL) directly and call its
/// collectives: that works unchanged in libtorch 1.13, where backends *are* c10d::ProcessGroups,
/// and in 2.x, where they are c10d::Backends behind a dispatching wrapper we do not need (see the
/// c10d section of detail/torch_compat.hpp).
///
/// Every collective must be called in the same order with the same shapes on every rank; calls
/// from several threads of one rank must be serialised by the caller. The job's group (the
/// session's, rank_session.hpp) numbers and fingerprints each as it is issued
/// (progress/collective_log.hpp): the stall watchdog compares the ranks' calls, and a collective
/// that fails between ranks that called different ones throws DesyncError naming both calls
/// instead of the backend's words. (Other groups are not logged: their numbers would not match.)

#include <trainloop/detail/error_context.hpp>
#include <trainloop/detail/padded_rows.hpp>
#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/backend_factory.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
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
    ProcessGroup group;
    group.rank_ = options.rank;
    group.world_size_ = options.world_size;
    group.device_ = options.device;
    group.timeout_ = options.timeout;
    group.backend_kind_ = resolve_backend(options);
    group.store_ = c10::make_intrusive<::c10d::PrefixStore>(options.store_prefix, connect_store(options));
    group.backend_ = make_backend(group.backend_kind_, options, group.store_);
    return group;
  }

  /// This process's rank.
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int world_size() const { return world_size_; }
  /// The backend in use (never Auto).
  Backend backend() const { return backend_kind_; }
  /// Where collectives run: CPU for Gloo, the CUDA device for NCCL.
  torch::Device communication_device() const {
    return backend_kind_ == Backend::Nccl ? device_ : torch::Device(torch::kCPU);
  }
  /// True once create() has filled this group.
  bool valid() const { return static_cast<bool>(backend_); }
  /// From now on this group's collectives go to the process's collective log (the job's group only).
  void log_collectives() { logged_ = true; }
  /// The libtorch backend object, for collectives we do not wrap.
  const c10::intrusive_ptr<::trainloop::detail::CollectiveBackend>& native() const { return backend_; }
  /// The (prefixed) store, e.g. for small key/value exchanges.
  const c10::intrusive_ptr<::c10d::Store>& store() const { return store_; }

  /// Sums `tensor` over all ranks, in place. Any device, layout or dtype the backend supports;
  /// non-contiguous or off-device tensors are staged through a temporary.
  void all_reduce_sum(const torch::Tensor& tensor) { all_reduce(tensor, ::c10d::ReduceOp::SUM, "all_reduce_sum"); }

  /// Sums each tensor over all ranks, in place; tensors of one dtype and device travel as one
  /// flat buffer (one collective per dtype/device group, not one per tensor).
  void all_reduce_sum(const std::vector<torch::Tensor>& tensors) {
    for_each_flat_group(tensors, [&](const torch::Tensor& flat) {
      std::vector<torch::Tensor> list{flat};
      return native_checked()->allreduce(list, allreduce_options(::c10d::ReduceOp::SUM));
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
    const std::uint64_t seq = log_call(progress::CollectiveKind::AllReduceSum, tensor);
    return launched(seq, "all_reduce_sum_async", [&] { return native_checked()->allreduce(list, allreduce_options(::c10d::ReduceOp::SUM)); });
  }

  /// Element-wise maximum over all ranks, in place (e.g. "any rank wants to stop" flags).
  void all_reduce_max(const torch::Tensor& tensor) { all_reduce(tensor, ::c10d::ReduceOp::MAX, "all_reduce_max"); }

  /// Copies `root`'s values of each tensor into every rank's tensors (one flat buffer per
  /// dtype/device group). Shapes must already agree across ranks.
  void broadcast(const std::vector<torch::Tensor>& tensors, int root = 0) {
    check_root(root);
    for_each_flat_group(tensors, [&](const torch::Tensor& flat) {
      std::vector<torch::Tensor> list{flat};
      ::c10d::BroadcastOptions options;
      options.rootRank = root;
      options.timeout = timeout_;
      return native_checked()->broadcast(list, options);
    }, "broadcast", progress::CollectiveKind::Broadcast, root);
  }

  /// Single-tensor broadcast from `root`.
  void broadcast(const torch::Tensor& tensor, int root = 0) { broadcast(std::vector<torch::Tensor>{tensor}, root); }

  /// Gathers every rank's `tensor` (same shape and dtype on all ranks — keep it small and
  /// fixed-size, e.g. an int64 fingerprint) into a new tensor of shape [world_size, *shape] on
  /// `tensor`'s device; row r holds rank r's values.
  torch::Tensor all_gather(const torch::Tensor& tensor) {
    torch::NoGradGuard no_grad;
    torch::Tensor input = staged(tensor);
    std::vector<std::vector<torch::Tensor>> outputs(1);
    for (int r = 0; r < world_size_; ++r) outputs[0].push_back(torch::empty_like(input));
    std::vector<torch::Tensor> inputs{input};
    ::c10d::AllgatherOptions options;
    options.timeout = timeout_;
    const std::uint64_t seq = log_call(progress::CollectiveKind::AllGather, input);
    wait(launched(seq, "all_gather", [&] { return native_checked()->allgather(outputs, inputs, options); }), "all_gather");
    return torch::stack(outputs[0]).to(tensor.device());
  }

  /// Gathers every rank's `tensor` (same shape and dtype on all ranks) on `root` only: element r
  /// of the result, on `root`, holds rank r's values (on the CPU); other ranks get an empty list.
  /// Unlike all_gather, only `root` ever holds world_size() copies (ZeRO's state for a checkpoint).
  std::vector<torch::Tensor> gather_to(const torch::Tensor& tensor, int root) {
    check_root(root);
    torch::NoGradGuard no_grad;
    torch::Tensor input = staged(tensor);
    std::vector<std::vector<torch::Tensor>> outputs;
    if (rank_ == root) {
      outputs.emplace_back();
      for (int r = 0; r < world_size_; ++r) outputs[0].push_back(torch::empty_like(input));
    }
    std::vector<torch::Tensor> inputs{input};
    ::c10d::GatherOptions options;
    options.rootRank = root;
    options.timeout = timeout_;
    const std::uint64_t seq = log_call(progress::CollectiveKind::Gather, input, root);
    wait(launched(seq, "gather", [&] { return native_checked()->gather(outputs, inputs, options); }), "gather");
    std::vector<torch::Tensor> rows;
    if (rank_ == root) {
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
  /// every rank's chunk r (a sharded optimizer's gradient step). NCCL, and Gloo in libtorch 2.x,
  /// have reduce_scatter; libtorch 1.13's Gloo declares it but throws "does not support
  /// reduce_scatter" before sending anything, on every rank alike. Then the whole input is
  /// all-reduced and this rank's chunk copied out: the same sums for twice the bytes on the wire
  /// (2(W-1)/W of the input per rank instead of (W-1)/W). Decided on the first call, once per group.
  void reduce_scatter_sum(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    check_sharded_sizes(input, output, "reduce_scatter_sum");
    torch::Tensor flat_input = staged(input).reshape({-1});
    torch::Tensor shard = staged(output);
    if (native_reduce_scatter_) {
      std::vector<std::vector<torch::Tensor>> inputs{std::vector<torch::Tensor>(flat_input.chunk(world_size_))};
      std::vector<torch::Tensor> outputs{shard.reshape({-1})};
      ::c10d::ReduceScatterOptions options;
      options.reduceOp = ::c10d::ReduceOp::SUM;
      options.timeout = timeout_;
      WorkHandle work;
      try {
        const std::uint64_t seq = log_call(progress::CollectiveKind::ReduceScatter, flat_input);
        work = logged(seq, native_checked()->reduce_scatter(outputs, inputs, options));
      } catch (const c10::Error&) {
        // Gloo 1.13 refuses reduce_scatter before sending anything, so every rank falls back alike.
        native_reduce_scatter_ = false;
      }
      if (work) {
        wait(work, "reduce_scatter");
        if (!shard.is_same(output)) output.copy_(shard);
        return;
      }
    }
    torch::Tensor summed = flat_input.clone();
    all_reduce(summed, ::c10d::ReduceOp::SUM, "reduce_scatter (as all_reduce)");
    output.copy_(summed.narrow(0, rank_ * output.numel(), output.numel()).view_as(output));
  }

  /// True while reduce_scatter_sum() uses the backend's own reduce-scatter (false once a backend
  /// without one, libtorch 1.13's Gloo, made it fall back to an all-reduce).
  bool native_reduce_scatter() const { return native_reduce_scatter_; }

  /// Concatenates every rank's `input` (the same number of elements on every rank) in rank order
  /// into `output` (world_size() times as many): a sharded optimizer's parameter step. An
  /// allgather into views of `output`, which every backend has.
  void all_gather_into(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    check_sharded_sizes(output, input, "all_gather_into");
    torch::Tensor gathered = staged(output);
    wait(all_gather_into_async(staged(input), gathered), "all_gather_into");
    if (gathered.data_ptr() != output.data_ptr()) output.copy_(gathered.view_as(output));  // it was staged
  }

  /// Starts all_gather_into() and returns at once; pass the handle to wait() before reading
  /// `output`. Both tensors must be contiguous and on communication_device() (nothing can be
  /// staged for them), and `output` must stay alive until then.
  WorkHandle all_gather_into_async(const torch::Tensor& input, const torch::Tensor& output) {
    torch::NoGradGuard no_grad;
    check_sharded_sizes(output, input, "all_gather_into_async");
    TRAINLOOP_CHECK(input.is_contiguous() && output.is_contiguous() && input.device() == communication_device() &&
                        output.device() == communication_device(),
                    "all_gather_into_async needs contiguous tensors on ", communication_device(), "; got them on ",
                    input.device(), " and ", output.device());
    std::vector<std::vector<torch::Tensor>> outputs{std::vector<torch::Tensor>(output.reshape({-1}).chunk(world_size_))};
    std::vector<torch::Tensor> inputs{input.reshape({-1})};
    ::c10d::AllgatherOptions options;
    options.timeout = timeout_;
    const std::uint64_t seq = log_call(progress::CollectiveKind::AllGather, input);
    return launched(seq, "all_gather_into", [&] { return native_checked()->allgather(outputs, inputs, options); });
  }

  /// Blocks until every rank has reached the barrier.
  void barrier() {
    ::c10d::BarrierOptions options;
    options.timeout = timeout_;
    if (backend_kind_ == Backend::Nccl && device_.has_index()) options.device_ids = {device_.index()};
    const std::uint64_t seq = log_call(progress::CollectiveKind::Barrier, torch::Tensor());
    wait(launched(seq, "barrier", [&] { return native_checked()->barrier(options); }), "barrier");
  }

  /// Waits for an asynchronous collective; a failure (peer died, timeout) becomes a
  /// trainloop::CommunicationError naming `what`, this rank and the timeout — or a
  /// trainloop::DesyncError naming both calls when the stall watchdog finds that the ranks called
  /// different collectives; running out of memory stays a c10::OutOfMemoryError (with that
  /// context added). While it blocks, the stall watchdog sees which collective it waits for.
  void wait(const WorkHandle& work, const char* what = "collective") const {
    progress::CollectiveLog& log = progress::progress_beacon().collectives();
    std::uint64_t seq = 0;
    if (logged_) {
      seq = log.seq_of(work.get());
      if (seq == 0) seq = log.issued();
      log.begin_wait(seq, what);
    }
    struct EndWait {
      progress::CollectiveLog& log;
      std::uint64_t seq;
      ~EndWait() { log.end_wait(seq); }
    } end_wait{log, seq};
    try {
      work->wait();
    } catch (...) {
      rethrow_collective_failure(seq, what);
    }
  }

 private:
  /// Turns the exception being handled, of collective `seq`, into what wait() documents.
  [[noreturn]] void rethrow_collective_failure(std::uint64_t seq, const char* what) const {
    try {
      throw;
    } catch (const c10::OutOfMemoryError&) {
      // Not a communication failure: the caller may react to it (a smaller batch).
      ::trainloop::detail::rethrow_with_context(::trainloop::detail::concat(
          "trainloop: ", what, " on rank ", rank_, " of ", world_size_, " ran out of memory"));
    } catch (const std::exception& error) {
      if (auto desync = progress::progress_beacon().collectives().explain_failure(seq)) {
        throw DesyncError(::trainloop::detail::concat("trainloop: ", what, " failed on rank ", rank_, " of ",
                                                      world_size_, ": ", *desync));
      }
      throw CommunicationError(::trainloop::detail::concat(
          "trainloop: ", what, " failed on rank ", rank_, " of ", world_size_, " (", to_string(backend_kind_),
          ", timeout ", timeout_.count(), " ms; did another rank fail or call a different collective?): ",
          error.what()));
    }
    throw;  // not a std::exception: as it is
  }

  const c10::intrusive_ptr<::trainloop::detail::CollectiveBackend>& native_checked() const {
    TRAINLOOP_CHECK(backend_, "collective on an empty ProcessGroup; expected one made by ProcessGroup::create()");
    return backend_;
  }

  /// `whole` must hold world_size() times the elements of `shard`, of the same dtype.
  void check_sharded_sizes(const torch::Tensor& whole, const torch::Tensor& shard, const char* what) const {
    TRAINLOOP_CHECK(whole.numel() == shard.numel() * world_size_, what, ": the whole tensor has ", whole.numel(),
                    " elements and a shard ", shard.numel(), "; expected ", world_size_, " x ", shard.numel(),
                    " (world size x shard)");
    TRAINLOOP_CHECK(whole.scalar_type() == shard.scalar_type(), what, ": the whole tensor is ",
                    c10::toString(whole.scalar_type()), " and the shard ", c10::toString(shard.scalar_type()),
                    "; expected one dtype");
  }

  void check_root(int root) const {
    TRAINLOOP_CHECK(root >= 0 && root < world_size_, "the root rank is ", root, "; expected 0 <= root < ",
                    world_size_);
  }

  /// Numbers and fingerprints a collective as it is issued (progress/collective_log.hpp); 0 for a
  /// group that is not logged.
  std::uint64_t log_call(progress::CollectiveKind kind, const torch::Tensor& sent, int root = -1) const {
    if (!logged_) return 0;
    progress::ProgressBeacon& beacon = progress::progress_beacon();
    return beacon.collectives().issue(kind, sent.defined() ? std::string(c10::toString(sent.scalar_type())) : "",
                                      sent.defined() ? sent.numel() : 0, root, beacon.global_step());
  }
  /// Ties collective `seq` to its handle, so a wait on it says which collective it waits for.
  static WorkHandle logged(std::uint64_t seq, WorkHandle work) {
    if (seq != 0) progress::progress_beacon().collectives().set_work(seq, work.get());
    return work;
  }
  /// Issues collective `seq` with `launch` and ties it to its handle; a backend that fails at
  /// once (Gloo finds a size mismatch while the call is issued) fails as wait() does.
  template <class Launch>
  WorkHandle launched(std::uint64_t seq, const char* what, Launch&& launch) const {
    try {
      return logged(seq, std::forward<Launch>(launch)());
    } catch (...) {
      rethrow_collective_failure(seq, what);
    }
  }

  ::c10d::AllreduceOptions allreduce_options(::c10d::ReduceOp op) const {
    ::c10d::AllreduceOptions options;
    options.reduceOp = op;
    options.timeout = timeout_;
    return options;
  }

  /// `tensor` itself when the backend can work on it in place, else a contiguous copy on the
  /// communication device (the caller copies results back).
  torch::Tensor staged(const torch::Tensor& tensor) const {
    if (tensor.is_contiguous() && tensor.device() == communication_device()) return tensor;
    return tensor.to(communication_device()).contiguous();
  }

  void all_reduce(const torch::Tensor& tensor, ::c10d::ReduceOp op, const char* what) {
    torch::NoGradGuard no_grad;
    torch::Tensor work_tensor = staged(tensor);
    std::vector<torch::Tensor> list{work_tensor};
    const std::uint64_t seq = log_call(
        op == ::c10d::ReduceOp::MAX ? progress::CollectiveKind::AllReduceMax : progress::CollectiveKind::AllReduceSum,
        work_tensor);
    wait(launched(seq, what, [&] { return native_checked()->allreduce(list, allreduce_options(op)); }), what);
    if (!work_tensor.is_same(tensor)) tensor.copy_(work_tensor);
  }

  /// Tensors of at least this many bytes get a collective of their own, run in place: for
  /// them, copying into and out of a flat buffer costs more than the extra collective saves
  /// (measured with Gloo on 2 thread-ranks: 62 × 0.7 MB broadcast 150 ms alone vs 255 ms flat;
  /// 200 × 2 KB: 58 ms alone vs 1.4 ms flat).
  static constexpr std::int64_t kOwnCollectiveBytes = std::int64_t{256} << 10;

  /// Runs `launch` on every tensor of at least kOwnCollectiveBytes (in place when it is
  /// contiguous on the communication device) and on one flat buffer per (dtype, device) group of
  /// the smaller ones, waits for all, and copies results back. The split depends only on sizes
  /// and dtypes, so ranks with equal shapes issue identical collectives in identical order.
  template <class Launch>
  void for_each_flat_group(const std::vector<torch::Tensor>& tensors, Launch&& launch, const char* what,
                           progress::CollectiveKind kind, int root = -1) {
    torch::NoGradGuard no_grad;
    std::vector<std::vector<std::size_t>> groups;  // each: tensor indices sharing one collective
    std::map<std::pair<int, std::string>, std::size_t> group_of_key;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      TRAINLOOP_CHECK(tensors[i].defined(), what, ": tensor ", i, " is undefined; expected defined tensors");
      if (tensors[i].numel() * static_cast<std::int64_t>(tensors[i].element_size()) >= kOwnCollectiveBytes) {
        groups.push_back({i});
        continue;
      }
      auto key = std::make_pair(static_cast<int>(tensors[i].scalar_type()), tensors[i].device().str());
      auto [it, inserted] = group_of_key.emplace(key, groups.size());
      if (inserted) groups.emplace_back();
      groups[it->second].push_back(i);
    }
    std::vector<torch::Tensor> buffers;
    std::vector<WorkHandle> works;
    std::vector<char> in_place(groups.size(), 0);
    for (const auto& group : groups) {
      if (group.size() == 1) {
        torch::Tensor buffer = staged(tensors[group[0]]);
        in_place[buffers.size()] = buffer.is_same(tensors[group[0]]);
        buffers.push_back(buffer.view({-1}));
      } else {
        std::vector<torch::Tensor> pieces;
        for (std::size_t i : group) pieces.push_back(tensors[i].reshape({-1}).to(communication_device()));
        buffers.push_back(torch::cat(pieces));
      }
      const std::uint64_t seq = log_call(kind, buffers.back(), root);
      works.push_back(launched(seq, what, [&] { return launch(buffers.back()); }));
    }
    for (std::size_t g = 0; g < groups.size(); ++g) {
      wait(works[g], what);
      if (in_place[g]) continue;
      std::int64_t offset = 0;
      for (std::size_t i : groups[g]) {
        const torch::Tensor& target = tensors[i];
        target.copy_(buffers[g].narrow(0, offset, target.numel()).view(target.sizes()));
        offset += target.numel();
      }
    }
  }

  int rank_ = 0;
  int world_size_ = 0;
  Backend backend_kind_ = Backend::Gloo;
  bool native_reduce_scatter_ = true;
  bool logged_ = false;  // log_collectives() was called  // false once the backend said it has none (libtorch 1.13's Gloo)
  torch::Device device_ = torch::kCPU;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<::c10d::Store> store_;
  c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> backend_;
};

}  // namespace trainloop::distributed
