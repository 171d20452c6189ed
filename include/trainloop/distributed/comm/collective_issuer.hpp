#pragma once
/// @file
/// @brief How a ProcessGroup (distributed/comm/process_group.hpp) issues one collective on its
/// backend and waits for it: tensors staged on the communication device when the backend cannot
/// work on them in place; each call numbered and fingerprinted in the process's collective log
/// (progress/collective_log.hpp) when the group is the logged one, and tied to its handle, so
/// that a wait says which collective it waits for; a failure at launch or in the wait worded by
/// collective_failure.hpp.

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/abandonable_wait.hpp>
#include <trainloop/distributed/comm/collective_failure.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/error.hpp>
#include <trainloop/progress/collective_log.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <utility>

namespace trainloop::distributed::detail {

/// A group's backend and what every collective on it shares (see the file comment). Copies share
/// the backend.
class CollectiveIssuer {
 public:
  /// An issuer of no group: every collective through it throws.
  CollectiveIssuer() = default;
  /// @param rank this process's rank in the group
  /// @param world_size the number of ranks
  /// @param backend the backend in use (never Auto)
  /// @param device this rank's compute device (NCCL's collectives run there)
  /// @param timeout the limit of each collective
  /// @param native the backend object the collectives are called on
  CollectiveIssuer(int rank, int world_size, Backend backend, torch::Device device, std::chrono::milliseconds timeout,
                   c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> native)
      : rank_(rank), world_size_(world_size), backend_kind_(backend), device_(device), timeout_(timeout),
        backend_(std::move(native)) {}

  /// This process's rank.
  int rank() const { return rank_; }
  /// Number of ranks in the group.
  int world_size() const { return world_size_; }
  /// The backend in use.
  Backend backend() const { return backend_kind_; }
  /// This rank's compute device.
  torch::Device device() const { return device_; }
  /// The limit of each collective.
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Where collectives run: CPU for Gloo, the CUDA device for NCCL.
  torch::Device communication_device() const {
    return backend_kind_ == Backend::Nccl ? device_ : torch::Device(torch::kCPU);
  }
  /// The backend object; empty for an issuer of no group.
  const c10::intrusive_ptr<::trainloop::detail::CollectiveBackend>& native() const { return backend_; }
  /// The backend object.
  /// @throws trainloop::ConfigurationError for an issuer of no group.
  const c10::intrusive_ptr<::trainloop::detail::CollectiveBackend>& native_checked() const {
    TRAINLOOP_CHECK(backend_, "collective on an empty ProcessGroup; expected one made by ProcessGroup::create()");
    return backend_;
  }
  /// From now on the collectives go to the process's collective log (the job's group only).
  void log_collectives() { logged_ = true; }

  /// `tensor` itself when the backend can work on it in place, else a contiguous copy on the
  /// communication device (the caller copies results back).
  torch::Tensor staged(const torch::Tensor& tensor) const {
    if (tensor.is_contiguous() && tensor.device() == communication_device()) return tensor;
    return tensor.to(communication_device()).contiguous();
  }

  /// An all-reduce's options: `op`, and the group's timeout.
  ::c10d::AllreduceOptions allreduce_options(::c10d::ReduceOp op) const {
    ::c10d::AllreduceOptions options;
    options.reduceOp = op;
    options.timeout = timeout_;
    return options;
  }

  /// Checks that `root` is a rank of the group.
  void check_root(int root) const {
    TRAINLOOP_CHECK(root >= 0 && root < world_size_, "the root rank is ", root, "; expected 0 <= root < ",
                    world_size_);
  }

  /// Checks that `whole` holds world_size() times the elements of `shard`, of the same dtype.
  void check_sharded_sizes(const torch::Tensor& whole, const torch::Tensor& shard, const char* what) const {
    TRAINLOOP_CHECK(whole.numel() == shard.numel() * world_size_, what, ": the whole tensor has ", whole.numel(),
                    " elements and a shard ", shard.numel(), "; expected ", world_size_, " x ", shard.numel(),
                    " (world size x shard)");
    TRAINLOOP_CHECK(whole.scalar_type() == shard.scalar_type(), what, ": the whole tensor is ",
                    c10::toString(whole.scalar_type()), " and the shard ", c10::toString(shard.scalar_type()),
                    "; expected one dtype");
  }

  /// Numbers and fingerprints a collective of `kind` sending `sent` (to or from `root`) as it is
  /// issued; 0 for a group that is not logged.
  std::uint64_t log_call(progress::CollectiveKind kind, const torch::Tensor& sent, int root = -1) const {
    if (!logged_) return 0;
    progress::ProgressBeacon& beacon = progress::progress_beacon();
    return beacon.collectives().issue(kind, sent.defined() ? std::string(c10::toString(sent.scalar_type())) : "",
                                      sent.defined() ? sent.numel() : 0, root, beacon.global_step());
  }
  /// Ties collective `seq` to its handle `work`, so a wait on it says which collective it waits for.
  static ::trainloop::detail::WorkHandle logged(std::uint64_t seq, ::trainloop::detail::WorkHandle work) {
    if (seq != 0) progress::progress_beacon().collectives().set_work(seq, work.get());
    return work;
  }
  /// Issues collective `seq` (`what`) with `launch` and ties it to its handle; a backend that
  /// fails at once (Gloo finds a size mismatch while the call is issued) fails as wait() does.
  template <class Launch>
  ::trainloop::detail::WorkHandle launched(std::uint64_t seq, const char* what, Launch&& launch) const {
    try {
      return logged(seq, std::forward<Launch>(launch)());
    } catch (...) {
      rethrow_failure(seq, what);
    }
  }

  /// Waits for an asynchronous collective (`what`); a failure becomes what
  /// rethrow_collective_failure() makes of it. While it blocks, the collective log (and so the
  /// stall watchdog) sees which collective it waits for.
  void wait(const ::trainloop::detail::WorkHandle& work, const char* what) const {
    const LoggedWait logged_wait = begin_wait(work, what);
    const std::uint64_t seq = logged_wait.seq;
    // Elastic training: a wait on a group that lost a rank is abandoned (abandonable_wait.hpp).
    if (!wait_unless_abandoned(work, current_abandon_probe())) {
      throw CommunicationError(::trainloop::detail::concat(
          "trainloop: rank ", rank_, " stopped waiting for its ", what, " (", world_size_,
          " ranks): a rank of the group was lost, and the survivors regroup (elastic training)"));
    }
    try {
      work->wait();
    } catch (...) {
      rethrow_failure(seq, what);
    }
  }

  /// Waits for a point-to-point operation (`what`, point_to_point.hpp). Gloo's send and
  /// receive complete only inside their own wait(), so no completion can be polled and the probe
  /// of an elastic group cannot abandon the wait: a lost peer's closed connection ends it with an
  /// error instead, and the group's timeout bounds it. The collective log sees the wait.
  void wait_point_to_point(const ::trainloop::detail::WorkHandle& work, const char* what) const {
    const LoggedWait logged_wait = begin_wait(work, what);
    const std::uint64_t seq = logged_wait.seq;
    try {
      work->wait(timeout_);
    } catch (...) {
      rethrow_failure(seq, what);
    }
  }

  /// Turns the exception being handled, of collective `seq` (`what`), into what wait() documents.
  [[noreturn]] void rethrow_failure(std::uint64_t seq, const char* what) const {
    rethrow_collective_failure(seq, what, rank_, world_size_, backend_kind_, timeout_);
  }

 private:
  /// A wait the collective log (and so the stall watchdog) sees, from begin_wait() to its end.
  struct LoggedWait {
    progress::CollectiveLog& log;
    std::uint64_t seq;
    LoggedWait(progress::CollectiveLog& wait_log, std::uint64_t wait_seq) : log(wait_log), seq(wait_seq) {}
    LoggedWait(const LoggedWait&) = delete;
    LoggedWait& operator=(const LoggedWait&) = delete;
    ~LoggedWait() { log.end_wait(seq); }
  };
  LoggedWait begin_wait(const ::trainloop::detail::WorkHandle& work, const char* what) const {
    progress::CollectiveLog& log = progress::progress_beacon().collectives();
    std::uint64_t seq = 0;
    if (logged_) {
      seq = log.seq_of(work.get());
      if (seq == 0) seq = log.issued();
      log.begin_wait(seq, what);
    }
    return LoggedWait{log, seq};
  }

  int rank_ = 0;
  int world_size_ = 0;
  Backend backend_kind_ = Backend::Gloo;
  bool logged_ = false;  // log_collectives() was called
  torch::Device device_ = torch::kCPU;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<::trainloop::detail::CollectiveBackend> backend_;
};

}  // namespace trainloop::distributed::detail
