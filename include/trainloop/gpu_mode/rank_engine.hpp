#pragma once
/// @file
/// @brief What every multi-process engine does the same way, whatever it does with gradients:
/// who this process is in the job, joining the process group (and the stall watchdog), the
/// collectives the loop agrees through, starting every fit from rank 0's state, broadcasting
/// buffers after a step, evaluating a batch, and the three ways a fit() runs (launch ranks, join
/// as one, or pass/train a spawned rank's fit), and the sharded state (distributed/zero/
/// sharded_state.hpp: DDP's with zero(true), fsdp's always; replicated otherwise) with the
/// checkpoint members it answers. DistributedDataParallelEngine and FullyShardedEngine derive
/// from it and add their gradient path.
///
/// How a run goes:
/// - In a plain process, fit() becomes the launcher: it saves the model and optimizer, re-executes
///   this program once per local rank (distributed::Launcher), waits, and loads the trained state back,
///   so the caller's model is trained when fit() returns. If a rank fails, the others are killed
///   and fit() throws naming the rank and its error.
/// - In a rank (spawned by us, or started by torchrun, Slurm `srun` or Open MPI `mpirun`), fit()
///   joins the process group, broadcasts rank 0's parameters and buffers, trains its shard of the
///   data, and returns on every rank. A rank we spawned ends its process when its fit() is done:
///   the program after fit() runs once, in the launching process.

#include <trainloop/checkpoint/checkpoint_mailbox.hpp>
#include <trainloop/checkpoint/checkpoint_shares.hpp>
#include <trainloop/cpu/threads.hpp>
#include <trainloop/distributed/comm/model_sync.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/comm/rank_session.hpp>
#include <trainloop/distributed/job/group_formed.hpp>
#include <trainloop/distributed/elastic/admission.hpp>
#include <trainloop/distributed/elastic/elastic_fit.hpp>
#include <trainloop/distributed/elastic/replacement_join.hpp>
#include <trainloop/distributed/elastic/share_copies.hpp>
#include <trainloop/distributed/job/rank_env.hpp>
#include <trainloop/distributed/job/replacement.hpp>
#include <trainloop/distributed/spawn/spawn_relay.hpp>
#include <trainloop/distributed/watch/watchdog_start.hpp>
#include <trainloop/distributed/zero/sharded_state.hpp>
#include <trainloop/engine/fit_actions.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>
#include <trainloop/gpu_mode/single.hpp>
#include <trainloop/history.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/detail/torch_compat.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// @brief The shared part of a multi-process engine (this file's comment); `Mode` is its policy
/// (a gpu_mode::MultiProcess).
template <class Module, class Mode>
class RankEngine {
 public:
  RankEngine(const Mode& mode, std::shared_ptr<Module> module)
      : mode_(mode), module_(std::move(module)), env_(distributed::detail::cached_rank_env()) {
    mode_.validate();
    if (env_) {
      device_ = rank_device();
    } else if (auto parameters = module_->parameters(); !parameters.empty()) {
      device_ = parameters.front().device();  // the launching process evaluates where the model is
    }
  }

  /// A rank trainloop's launcher started (its fits train from the caller's checkpoint).
  bool spawned() const { return env_ && env_->source == distributed::RankEnvSource::Trainloop; }

  // ---- the mode interface -------------------------------------------------------------
  bool is_main() const { return rank() == 0; }
  // The group's once joined: after a lost rank (elastic training) the survivors are renumbered.
  int64_t rank() const { return group_ ? group_->rank() : env_ ? env_->rank : 0; }
  int64_t world_size() const { return group_ ? group_->world_size() : env_ ? env_->world_size : 1; }
  torch::Device device() const { return device_; }
  DataShard data_shard() const { return {rank(), world_size()}; }
  void all_reduce_sum(torch::Tensor& tensor) {
    if (group_) group_->all_reduce_sum(tensor);
  }
  torch::Tensor all_gather(const torch::Tensor& tensor) {
    return group_ ? group_->all_gather(tensor) : tensor.unsqueeze(0);
  }
  bool any_rank(bool flag) {
    if (!group_ || group_->world_size() == 1) return flag;  // one rank agrees with itself: no host sync
    auto value = torch::full({1}, flag ? 1.0 : 0.0, torch::TensorOptions().dtype(torch::kFloat32).device(device_));
    group_->all_reduce_max(value);
    return value.item<float>() > 0.5f;
  }
  void barrier() {
    if (group_) group_->barrier();
  }

  /// In a rank: threads, the model on this rank's device, the process group, and — in a rank that
  /// joined (torchrun, srun, mpirun) — every rank holding rank 0's parameters and buffers. Once;
  /// every entry point calls it, so evaluate() before fit() is exact too. A rank we spawned skips
  /// the broadcast: its fit() starts by loading the caller's state from initial.ckpt, the same file
  /// on every rank (what it evaluates before that is a replay nobody sees: the launching process
  /// evaluates the caller's model locally). In the launching process: nothing.
  void prepare() {
    if (!env_ || group_) return;
    cpu::apply_intra_op_threads(cpu::intra_op_threads_for(env_->local_world_size));
    module_->to(device_);
    // A replacement joins the running fit's group when the others admit it (its fit: run_fit); what
    // it evaluates before is a replay nobody sees, as in any rank we spawned.
    if (distributed::awaiting_admission()) return;
    distributed::ProcessGroupOptions options;
    options.backend = mode_.backend();
    options.device = device_;
    options.timeout = mode_.timeout();
    group_ = &distributed::session_process_group(options);
    // Every launcher's ranks pass here: spawned, torchrun, srun, mpirun.
    distributed::start_stall_watchdog(distributed::detail::session_group().options, *env_, mode_.stall_watch());
    if (mode_.elastic()) {
      distributed::elastic::make_job_group_elastic(*group_);
      distributed::mark_group_formed(*env_);  // from now on a lost rank is survived (launcher.hpp)
    }
    if (!spawned()) {
      distributed::broadcast_module_state(*module_, *group_);  // checks every rank holds the same shapes first
      synced_since_join_ = true;
    }
  }

  /// After every step: rank 0's buffers (BatchNorm's running statistics) to every rank (with
  /// elastic training the step's commit sent them: distributed/elastic/step_committer.hpp).
  void after_optimizer_step() {
    if (!buffers_.empty() && mode_.broadcast_buffers() && !commits_steps()) group_->broadcast(buffers_, 0);
  }

  // ---- elastic training: step commits (engine/step_commit.hpp) -----------------------------
  /// Every step commits under elastic training with two ranks or more, and on one rank that may
  /// admit replacements (the commit is where the ranks agree to, and what they resume from).
  bool commits_steps() const {
    return mode_.elastic() && group_ != nullptr && (group_->world_size() > 1 || admits_replacements());
  }
  /// Elastic training of sharded state: each step's shares copied, and sent to a neighbour
  /// (distributed/elastic/share_copies.hpp).
  bool keeps_share_copies() const { return commits_steps() && group_->world_size() > 1 && sharded_.holds_share(); }
  /// Elastic training under trainloop's launcher: replacements of lost ranks may ask to join.
  bool admits_replacements() const { return mode_.elastic() && spawned() && mode_.max_replacements() > 0; }
  /// How many replacements the ranks agreed at the last commit to admit (0: none wait).
  int64_t replacements_agreed() const { return commits_steps() ? commits_.joins_waiting() : 0; }
  /// At the step boundary after that commit: the elastic fit admits them (distributed/elastic/elastic_fit.hpp).
  [[noreturn]] void admit_replacements() const { throw distributed::elastic::ReplacementsJoin(commits_.joins_waiting()); }
  /// The copies of the state the last step left (global step `step`): this rank's `shares`, on
  /// rank 0 `whole` and `volatile_whole` and the loop's state (`write_loop_state`). A collective.
  void keep_share_copies(int64_t step, const std::vector<TensorShare>& shares,
                         const std::vector<std::pair<std::string, torch::Tensor>>& whole,
                         const std::vector<std::pair<std::string, torch::Tensor>>& volatile_whole,
                         const std::function<void(const std::filesystem::path&)>& write_loop_state) {
    share_copies_.keep(*group_, *env_, step, shares, whole, volatile_whole, rank() == 0 ? write_loop_state : nullptr);
  }
  void stage_step_totals(const torch::Tensor& totals) { commits_.stage(totals); }
  std::optional<CommittedRows> committed_rows() const { return commits_.rows(); }
  /// Zeroes the gradients keeping their tensors (in libtorch 2.x too, whose default sets them to
  /// none): gradients kept as bucket views stay views.
  void zero_grad(torch::optim::Optimizer& optimizer) { zero_grad_in_place(optimizer); }

  template <class Batch, class Forward, class Sink>
  void eval_batch(const Batch& batch, Forward&& forward, Sink&& sink) {
    torch::NoGradGuard no_grad;
    sink(forward(*module_, batch_to_device(batch, device_)));
  }

  // ---- checkpoints: the sharded state answers (engine/sharded_members.hpp) ----------------
  /// Every rank writes its share of a per-rank checkpoint once it holds one (a fit laid the state
  /// out, or a per-rank checkpoint's load did); before, and when nothing is sharded, rank 0
  /// writes one archive.
  bool writes_sharded_checkpoint() const { return sharded_.holds_share() && world_size() > 1; }
  /// This rank's pieces of the parameters and of their optimizer state (views, no copy).
  std::vector<TensorShare> checkpoint_shares(Module& module, torch::optim::Optimizer& optimizer) {
    return sharded_.shares(module, optimizer, /*values_from_pieces=*/false);
  }
  /// The ranks' checkpoint writers' messages through the job group's store (checkpoint/checkpoint_mailbox.hpp);
  /// none outside a rank.
  detail::CheckpointMailbox checkpoint_mailbox() {
    if (!group_) return {};
    c10::intrusive_ptr<::c10d::Store> store = group_->store();
    detail::CheckpointMailbox mailbox;
    mailbox.post = [store](const std::string& key, const std::string& value) {
      store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    };
    mailbox.take = [store](const std::string& key) -> std::optional<std::string> {
      if (!store->check({key})) return std::nullopt;
      const std::vector<uint8_t> value = store->get(key);
      store->deleteKey(key);
      return std::string(value.begin(), value.end());
    };
    return mailbox;
  }
  /// Resuming from a per-rank checkpoint in a rank: lays the state out as the fit will and reads
  /// only this rank's pieces of the optimizer state; false in the launching process, on one rank
  /// and when nothing is sharded (the loop then loads the whole state).
  bool load_optimizer_shares(torch::optim::Optimizer& optimizer, ShareSource& source) {
    if (!env_ || world_size() == 1) return false;
    return sharded_.load_shares(optimizer, *module_, source, static_cast<int>(world_size()), static_cast<int>(rank()));
  }
  /// A checkpoint's optimizer part in libtorch's layout, a sharded state gathered on the writing
  /// rank (a collective while this rank holds a share).
  void save_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::OutputArchive& archive, bool writes) {
    sharded_.save_whole(group_, optimizer, archive, writes);
  }
  /// Loads a whole state (any mode's checkpoint), of which a sharded rank keeps its share.
  void load_optimizer_state(torch::optim::Optimizer& optimizer, torch::serialize::InputArchive& archive) {
    sharded_.load_whole(optimizer, archive);
  }

  /// Runs the loop the way this process's role requires: launch ranks (distributed/spawn/spawn_relay.hpp),
  /// join as a rank (torchrun, Slurm, Open MPI), or, in a rank we spawned, pass or train the
  /// matching fit() call.
  History run_fit(const FitActions& actions, const ResumeSpec& resume) {
    const int fit_index = distributed::detail::next_fit_index();
    if (!env_) {
      distributed::SpawnFitOptions spawn;
      spawn.fit_index = fit_index;
      spawn.max_restarts = mode_.max_restarts();
      distributed::LaunchOptions launch = mode_.launch_options();
      // Another machine's launcher finds the job training this call already: this machine stands in
      // for a lost one, its ranks join as replacements (distributed/elastic/replacement_join.hpp).
      if (mode_.elastic() && launch.node_rank() > 0) {
        launch.joins_running_fit(
            distributed::elastic::running_fit_admits(launch.master_addr(), launch.master_port(), fit_index));
      }
      return distributed::launch_spawned_fit(actions, launch, spawn);
    }
    FitActions rank_actions = actions;
    if (mode_.elastic()) {  // the fit survives a lost rank (distributed/elastic/elastic_fit.hpp)
      rank_actions.train = [this, actions](const ResumeSpec& from) {
        distributed::elastic::ElasticFitParts parts;
        parts.env = &*env_;
        parts.commits = &commits_;
        parts.elastic_wait = mode_.elastic_wait();
        parts.state_bytes = [this] {  // weights, and up to twice that of optimizer state (Adam's moments)
          std::uintmax_t bytes = 0;
          for (const auto& tensor : module_->parameters()) bytes += 3 * tensor.nbytes();
          for (const auto& tensor : module_->buffers()) bytes += tensor.nbytes();
          return bytes + (std::uintmax_t{1} << 20);
        };
        parts.put_back_committed_state = [this] {
          commits_.restore_buffers(module_->buffers());
          for (auto& parameter : module_->parameters()) parameter.mutable_grad().reset();  // a step half done
          sharded_.forget_layout();  // sharded state: laid out anew for the survivors, read from the hand-off
        };
        parts.hold_committed_buffers = [this] { commits_.hold_buffers_through_next_fit(module_->buffers()); };
        parts.share_copies = [this]() -> distributed::elastic::ShareCopies* {
          return keeps_share_copies() ? &share_copies_ : nullptr;
        };
        parts.join_watch = &join_watch_;
        parts.group_options.backend = mode_.backend();
        parts.group_options.device = device_;
        parts.group_options.timeout = mode_.timeout();
        return distributed::elastic::train_elastic(actions, from, parts);
      };
    }
    if (env_->source != distributed::RankEnvSource::Trainloop) return rank_actions.train(resume);
    return distributed::run_spawned_rank_fit(*env_, fit_index, rank_actions, resume, [this] { barrier(); });
  }

 protected:
  /// The start of every fit in a rank: joined, and every rank holding rank 0's state — one
  /// broadcast per fit in a joined rank (the one prepare() made when this fit joined the group, or
  /// a new one); none in a rank we spawned, which loads the caller's state, "initial.ckpt", as the
  /// loop resumes from it (every rank reads the same file). Lists the buffers to broadcast after
  /// each step (none with one rank).
  void join_fit() {
    TRAINLOOP_CHECK(env_.has_value(), "the ", Mode::name, " engine trained outside a rank; expected fit() to launch ranks");
    prepare();
    if (!spawned() && !std::exchange(synced_since_join_, false)) distributed::broadcast_module_state(*module_, *group_);
    if (group_->world_size() > 1) buffers_ = module_->buffers();
    commits_.begin_fit();
    share_copies_.reset();
  }
  /// Elastic training: the step's commit, once its gradients are reduced and before the optimizer
  /// steps (a collective; nothing without elastic training, or on one rank that admits no replacements).
  void commit_step() {
    if (!commits_steps()) return;
    // Rank 0 says how many replacements wait (a store lookup at most every 100 ms): every rank learns it here.
    // At most as many as bring the job back to the size it was launched with: a spare machine started
    // while every rank is alive waits, and takes the place of the next rank lost.
    const int64_t waiting =
        rank() == 0 && admits_replacements()
            ? std::min<int64_t>(join_watch_.waiting(*group_->job_store(), progress::progress_beacon().global_step() + 1),
                                std::max(0, env_->world_size - group_->world_size()))
            : 0;
    commits_.commit(*group_, buffers_, mode_.broadcast_buffers(), waiting);
  }
  /// What join_fit() listed, let go at the fit's end; the copies of sharded state too, unless the
  /// fit ends with an exception (a lost rank's survivors hand the state on from them).
  void leave_fit() noexcept {
    buffers_.clear();
    if (std::uncaught_exceptions() == 0) share_copies_.reset();
  }

  Mode mode_;
  std::shared_ptr<Module> module_;
  const std::optional<distributed::RankEnv>& env_;
  torch::Device device_ = torch::Device(torch::kCPU);
  distributed::ProcessGroup* group_ = nullptr;
  distributed::ShardedState sharded_;  // Replicated unless the engine's constructor shards it

 private:
  torch::Device rank_device() const {
    if (mode_.resolved_device_type() != torch::kCUDA) return torch::Device(torch::kCPU);
    const int local = env_->local_rank;
    const int index = mode_.gpus().empty() ? local : mode_.gpus().at(static_cast<size_t>(local));
    torch::Device device(torch::kCUDA, static_cast<c10::DeviceIndex>(index));
    check_device_available(device);
    return device;
  }

  distributed::elastic::StepCommitter commits_;  // elastic training: this fit's step commits
  distributed::elastic::ShareCopies share_copies_;  // elastic training of sharded state: the last two steps' copies
  distributed::elastic::JoinWatch join_watch_;      // elastic training, rank 0: the replacements waiting to join
  bool synced_since_join_ = false;      // prepare() broadcast rank 0's state and no fit has used that yet
  std::vector<torch::Tensor> buffers_;  // listed once per fit, broadcast after every step
};

}  // namespace trainloop::detail
