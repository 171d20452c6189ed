#pragma once
/// @file
/// @brief A rank's side of step commits (commit_record.hpp) during one fit: the sums the loop
/// staged, the last commit, and the buffers as they were committed. The engine calls commit()
/// once the step's gradients are reduced and before the optimizer steps; elastic_fit.hpp reads
/// what was committed when a rank is lost.
///
/// Rank 0's buffers (BatchNorm's running statistics) go to every rank at the commit instead of
/// after the optimizer step: the step does not change them, so the values are the same, and the
/// commit then holds them as the step left them — a survivor may have run the next step's
/// forward, which moves them, before it learned of the loss.

#include <trainloop/checkpoint/rng_state.hpp>
#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/elastic/commit_record.hpp>
#include <trainloop/engine/step_commit.hpp>
#include <trainloop/progress/progress_beacon.hpp>
#include <trainloop/progress/test_kill_point.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

namespace trainloop::distributed::elastic {

/// One rank's commits of one fit (see the file comment).
class StepCommitter {
 public:
  /// A new fit: nothing committed yet (the buffers hold_buffers_through_next_fit() held are kept).
  void begin_fit() {
    record_ = CommitRecord();
    staged_totals_ = torch::Tensor();
    if (!std::exchange(keep_buffers_, false)) committed_buffers_.clear();
  }

  /// `buffers` as they are now (the committed step's, put back) are held as committed through the
  /// next begin_fit(): the fit that follows resumes from that step with the model kept in memory
  /// (elastic_fit.hpp's hand-off in place), so until it commits, restore_buffers() puts back that
  /// step's buffers, which its forward may have moved — also on one rank, whose commits hold none.
  void hold_buffers_through_next_fit(const std::vector<torch::Tensor>& buffers) {
    torch::NoGradGuard no_grad;
    committed_buffers_.clear();
    for (const torch::Tensor& buffer : buffers) committed_buffers_.push_back(buffer.detach().clone());
    keep_buffers_ = true;
  }

  /// This rank's epoch sums for the coming commit (any device; packed float64).
  void stage(const torch::Tensor& totals) { staged_totals_ = totals; }

  /// The step's commit, a collective: rank 0's `buffers` to every rank (when `broadcast_buffers`),
  /// then every rank's sums and random stream to every rank, with rank 0's `joins_waiting`.
  void commit(ProcessGroup& group, const std::vector<torch::Tensor>& buffers, bool broadcast_buffers,
              std::int64_t joins_waiting = 0) {
    torch::NoGradGuard no_grad;
    if (!buffers.empty() && broadcast_buffers) group.broadcast(buffers, 0);
    const torch::Tensor totals = staged_totals_.defined()
                                     ? staged_totals_.detach().to(torch::kCPU, torch::kFloat64).reshape({-1})
                                     : torch::zeros({0}, torch::kFloat64);
    record_ = CommitRecord::gather(group, progress::progress_beacon().global_step() + 1, totals,
                                   ::trainloop::detail::capture_rng_state(), joins_waiting);
    staged_totals_ = torch::Tensor();
    committed_buffers_.resize(buffers.size());
    for (std::size_t i = 0; i < buffers.size(); ++i) {
      if (!committed_buffers_[i].defined() || !committed_buffers_[i].sizes().equals(buffers[i].sizes())) {
        committed_buffers_[i] = torch::empty_like(buffers[i]);  // reused across steps
      }
      committed_buffers_[i].copy_(buffers[i]);
    }
    if (after_next_commit_) std::exchange(after_next_commit_, nullptr)();
    progress::test_kill_point(progress::KillPoint::Optimizer);
  }

  /// Runs `action` once, right after the next commit (of this fit or the next: begin_fit() keeps
  /// it); empty: none. elastic_fit.hpp drops the hand-off it resumed from there.
  void after_next_commit(std::function<void()> action) { after_next_commit_ = std::move(action); }

  /// How many replacements the ranks agreed at the last commit are waiting to join (admission.hpp).
  std::int64_t joins_waiting() const { return record_.joins_waiting(); }

  /// The newest committed step of this fit, -1 when none.
  std::int64_t committed_step() const { return record_.committed() ? record_.step() : -1; }

  /// Every rank's streams and sums at the last commit (engine/step_commit.hpp), if any.
  std::optional<::trainloop::detail::CommittedRows> rows() const {
    if (!record_.committed()) return std::nullopt;
    ::trainloop::detail::CommittedRows rows;
    rows.world_size = record_.ranks();
    for (std::int64_t r = 0; r < record_.ranks(); ++r) {
      rows.rng.push_back(record_.rng(r));
      rows.totals.push_back(record_.totals(r));
    }
    return rows;
  }

  /// Puts the buffers back as they were committed (into `buffers`, the same list commit() had).
  void restore_buffers(const std::vector<torch::Tensor>& buffers) const {
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < buffers.size() && i < committed_buffers_.size(); ++i) buffers[i].copy_(committed_buffers_[i]);
  }

 private:
  CommitRecord record_;
  torch::Tensor staged_totals_;
  std::vector<torch::Tensor> committed_buffers_;
  bool keep_buffers_ = false;
  std::function<void()> after_next_commit_;
};

}  // namespace trainloop::distributed::elastic
