#pragma once
/// @file
/// @brief gpu_mode::MultiProcess: the settings every multi-process mode shares — how many ranks,
/// on which machines and devices, over which backend, with which limits — written once for
/// DistributedDataParallel (replicated gradients) and FullyShardedDataParallel (sharded ones).
///
/// A mode derives publicly from `MultiProcess<Mode>` (the curiously recurring template: each setter returns
/// the mode itself, so `gpu_mode::FullyShardedDataParallel().procs_per_node(4).sharding_units(...)`
/// chains across the shared and the mode's own settings).

#include <trainloop/detail/torch_compat.hpp>
#include <trainloop/distributed/comm/rendezvous.hpp>
#include <trainloop/distributed/launch/launch_options.hpp>
#include <trainloop/distributed/watch/stall_options.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

/// Declares a setting of a multi-process mode: a setter returning the mode (for chaining across
/// the shared settings and the mode's own), a getter, and the value with its default after the macro.
#define TRAINLOOP_MODE_ARG(T, name)                      \
 public:                                                 \
  Mode& name(const T& new_##name) {                      \
    name##_ = new_##name;                                \
    return static_cast<Mode&>(*this);                    \
  }                                                      \
  const T& name() const noexcept { return name##_; }     \
                                                         \
 private:                                                \
  T name##_

namespace trainloop::gpu_mode {

/// @brief The settings every multi-process mode shares (this file's comment); `Mode` is the mode
/// deriving from it.
template <class Mode>
class MultiProcess {
  /// Processes started on this node; 0 means one per visible CUDA device, or 2 on a CPU machine.
  TRAINLOOP_MODE_ARG(int, procs_per_node) = 0;
  /// Number of machines in the job.
  TRAINLOOP_MODE_ARG(int, nnodes) = 1;
  /// This machine's index in [0, nnodes); node 0 hosts rank 0.
  TRAINLOOP_MODE_ARG(int, node_rank) = 0;
  /// Host of rank 0's TCPStore: an address every node can reach.
  TRAINLOOP_MODE_ARG(std::string, master_addr) = "127.0.0.1";
  /// Port of rank 0's TCPStore; 0 picks a free port (single node only).
  TRAINLOOP_MODE_ARG(int, master_port) = 0;
  /// Collective backend: Auto picks NCCL for CUDA devices and Gloo for the CPU.
  TRAINLOOP_MODE_ARG(distributed::Backend, backend) = distributed::Backend::Auto;
  /// Device kind of the ranks: CPU, or CUDA (rank r uses gpus[local r], or cuda:local_rank).
  /// Unset: CUDA when available, else CPU.
  TRAINLOOP_MODE_ARG(std::optional<torch::DeviceType>, device_type) = std::nullopt;
  /// CUDA devices to use, one per local rank (like `fastai.launch --gpus 0,1`); empty = 0..n-1.
  TRAINLOOP_MODE_ARG(std::vector<int>, gpus) = {};
  /// Limit for joining the group and for each collective.
  TRAINLOOP_MODE_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(10);
  /// When a rank that makes no progress is named, and what happens then (distributed/watch/):
  /// by default after 60 s (or 10x the slowest step), ending the job; TRAINLOOP_STALL_LIMIT
  /// (seconds or "off") and TRAINLOOP_STALL_ACTION (fail|report) override it.
  TRAINLOOP_MODE_ARG(distributed::StallWatchOptions, stall_watch) = {};
  /// Seconds the launcher waits after SIGTERM before SIGKILL when a rank failed.
  TRAINLOOP_MODE_ARG(std::chrono::milliseconds, kill_grace_period) = std::chrono::seconds(3);
  /// Broadcast rank 0's buffers (BatchNorm running statistics) after every optimizer step.
  TRAINLOOP_MODE_ARG(bool, broadcast_buffers) = true;
  /// Spawn mode: when a rank fails, stop the others and start all ranks again, at most this many
  /// times; the restarted ranks resume from the newest checkpoint of the ModelCheckpoint given to
  /// fit() (from the start of the fit() call when there is none yet).
  TRAINLOOP_MODE_ARG(int, max_restarts) = 0;
  /// Elastic training (distributed/elastic/, docs/elastic.md): when a rank other than 0 is lost
  /// (killed, crashed, its machine gone), the others abandon the step in flight, agree through
  /// the store who is left, form a new group and go on from the newest step any of them
  /// committed, resharding the data over the survivors: no restart, nothing read from the
  /// checkpoints. Sharded state (ZeRO-1/2/3) too: each rank keeps a copy of its neighbour's
  /// shards, refreshed every step (distributed/elastic/share_copies.hpp; one machine in this
  /// release). Over Gloo, without a comm hook.
  TRAINLOOP_MODE_ARG(bool, elastic) = false;
  /// Elastic: how long a rank on another machine (whose process cannot be seen from here) has to
  /// report after a loss before it counts as lost too.
  TRAINLOOP_MODE_ARG(std::chrono::milliseconds, elastic_wait) = std::chrono::seconds(30);
  /// Elastic, trainloop's launcher: how many times the launcher starts a replacement for each
  /// rank's place when its process is lost; a replacement joins the running fit at a step
  /// boundary and brings the job back to its size (distributed/elastic/replacement_join.hpp).
  /// 0: the survivors go on alone.
  TRAINLOOP_MODE_ARG(int, max_replacements) = 1;

 public:
  /// @brief The device type ranks train on, after applying the default.
  torch::DeviceType resolved_device_type() const {
    return device_type_.value_or(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);
  }
  /// @brief Processes per node, after applying the default.
  int resolved_procs_per_node() const {
    if (procs_per_node_ > 0) return procs_per_node_;
    if (!gpus_.empty()) return static_cast<int>(gpus_.size());
    return resolved_device_type() == torch::kCUDA ? static_cast<int>(trainloop::detail::cuda_device_count()) : 2;
  }
  /// @brief How trainloop's launcher starts this node's ranks.
  distributed::LaunchOptions launch_options() const {
    distributed::LaunchOptions options(resolved_procs_per_node());
    options.nnodes(nnodes_).node_rank(node_rank_).master_addr(master_addr_).master_port(master_port_)
        .grace_period(kill_grace_period_).elastic(elastic_).max_replacements(elastic_ ? max_replacements_ : 0);
    return options;
  }
  /// @brief Throws trainloop::Error naming the first shared setting out of range.
  void validate_processes() const {
    TRAINLOOP_CHECK(procs_per_node_ >= 0, "procs_per_node is ", procs_per_node_, "; expected 0 (automatic) or more");
    TRAINLOOP_CHECK(nnodes_ >= 1, "nnodes is ", nnodes_, "; expected 1 or more");
    TRAINLOOP_CHECK(node_rank_ >= 0 && node_rank_ < nnodes_, "node_rank is ", node_rank_, "; expected 0 <= node_rank < ",
                    nnodes_);
    TRAINLOOP_CHECK(master_port_ >= 0 && master_port_ <= 65535, "master port is ", master_port_,
                    "; expected 0 (pick a free one) or 1..65535");
    TRAINLOOP_CHECK(nnodes_ == 1 || master_port_ != 0, "a job of ", nnodes_,
                    " nodes needs an explicit master port (every node must use the same); got 0");
    TRAINLOOP_CHECK(timeout_.count() > 0, "timeout is ", timeout_.count(),
                    " ms; expected a positive limit for joining the group and for each collective");
    distributed::stall_options_from_environment(stall_watch_).validate(timeout_);
    TRAINLOOP_CHECK(max_restarts_ >= 0, "max_restarts is ", max_restarts_, "; expected 0 or more");
    TRAINLOOP_CHECK(kill_grace_period_.count() >= 0, "kill_grace_period is ", kill_grace_period_.count(),
                    " ms; expected 0 or more");
    if (!gpus_.empty() && procs_per_node_ > 0)
      TRAINLOOP_CHECK(static_cast<int>(gpus_.size()) == procs_per_node_, "gpus lists ", gpus_.size(),
                      " devices but procs_per_node is ", procs_per_node_, "; expected one GPU per process");
    // Checked here, in the launching process, before any rank starts: otherwise only the ranks
    // past the last device fail ("device cuda:1 does not exist"), after the others began.
    TRAINLOOP_CHECK(resolved_device_type() != torch::kCUDA || !gpus_.empty() || procs_per_node_ == 0 ||
                        procs_per_node_ <= static_cast<int>(trainloop::detail::cuda_device_count()),
                    "procs_per_node is ", procs_per_node_, " on CUDA, but this machine has ", trainloop::detail::cuda_device_count(),
                    " visible CUDA device", trainloop::detail::cuda_device_count() == 1 ? "" : "s", "; expected at most ",
                    trainloop::detail::cuda_device_count(), " (one device per rank), or gpus({...}) naming each rank's device");
    TRAINLOOP_CHECK(!elastic_ || (backend_ == distributed::Backend::Gloo ||
                                  (backend_ == distributed::Backend::Auto && resolved_device_type() != torch::kCUDA)),
                    "elastic training with backend ", distributed::to_string(backend_), " on ",
                    resolved_device_type() == torch::kCUDA ? "CUDA" : "the CPU",
                    "; expected backend gloo (`backend(distributed::Backend::Gloo)`, `--backend gloo`; on CUDA its "
                    "collectives go through host memory): a lost rank's NCCL communicator is not aborted and re-created "
                    "in this release");
    TRAINLOOP_CHECK(max_replacements_ >= 0, "max_replacements is ", max_replacements_, "; expected 0 or more");
    TRAINLOOP_CHECK(elastic_wait_.count() > 0, "elastic_wait is ", elastic_wait_.count(), " ms; expected a positive time");
    TRAINLOOP_CHECK(resolved_procs_per_node() >= 1, "no CUDA device is visible, so no rank can be started; "
                                                    "expected device_type(torch::kCPU) or a visible GPU");
  }
  /// @brief Copies the shared settings of another multi-process mode (`--gpu-mode ddp --sharding
  /// full` turns a DDP mode into the sharded one with the same processes).
  template <class Other>
  Mode& processes_like(const MultiProcess<Other>& other) {
    procs_per_node_ = other.procs_per_node();
    nnodes_ = other.nnodes();
    node_rank_ = other.node_rank();
    master_addr_ = other.master_addr();
    master_port_ = other.master_port();
    backend_ = other.backend();
    device_type_ = other.device_type();
    gpus_ = other.gpus();
    timeout_ = other.timeout();
    stall_watch_ = other.stall_watch();
    kill_grace_period_ = other.kill_grace_period();
    broadcast_buffers_ = other.broadcast_buffers();
    max_restarts_ = other.max_restarts();
    elastic_ = other.elastic();
    elastic_wait_ = other.elastic_wait();
    max_replacements_ = other.max_replacements();
    return static_cast<Mode&>(*this);
  }
};

}  // namespace trainloop::gpu_mode
