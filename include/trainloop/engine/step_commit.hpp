#pragma once
/// @file
/// @brief The loop's side of elastic training (distributed/elastic/commit_record.hpp): an engine
/// that commits each step hands the loop nothing new to do but this — before each optimizer step
/// it is given this rank's epoch sums, which its commit gathers from every rank with the random
/// streams; and a checkpoint written by one process alone after a lost rank (the survivors'
/// hand-off) takes every rank's streams and sums from the last commit. At a step boundary inside
/// an epoch after a commit that agreed to admit replacements of lost ranks, the loop lets the
/// engine leave the fit for them. All are optional members with a replicated default: engines that
/// do not commit steps are untouched.

#include <torch/torch.h>

#include <concepts>
#include <cstdint>
#include <optional>
#include <vector>

namespace trainloop::detail {

/// Every rank's random stream and epoch sums at the last committed step.
struct CommittedRows {
  int64_t world_size = 0;            ///< ranks that committed it (the group before the loss)
  std::vector<torch::Tensor> rng;    ///< rank r's random stream (uint8), as capture_rng_state() packs it
  std::vector<torch::Tensor> totals; ///< rank r's epoch sums (float64), as MetricAccumulator packs them
};

/// Whether the engine commits each step (elastic training with several ranks).
template <class Engine>
bool commits_steps(const Engine& engine) {
  if constexpr (requires { { engine.commits_steps() } -> std::convertible_to<bool>; }) {
    return engine.commits_steps();
  } else {
    return false;
  }
}

/// Hands the engine this rank's epoch sums for the coming step's commit.
template <class Engine>
void stage_step_totals(Engine& engine, const torch::Tensor& totals) {
  if constexpr (requires { engine.stage_step_totals(totals); }) engine.stage_step_totals(totals);
}

/// The last commit's rows, if the engine committed a step in this fit.
template <class Engine>
std::optional<CommittedRows> committed_rows(const Engine& engine) {
  if constexpr (requires { { engine.committed_rows() } -> std::convertible_to<std::optional<CommittedRows>>; }) {
    return engine.committed_rows();
  } else {
    return std::nullopt;
  }
}

/// Replacements of lost ranks the engine's ranks agreed at the last commit to admit (0: none, or
/// an engine that admits none).
template <class Engine>
int64_t replacements_agreed(const Engine& engine) {
  if constexpr (requires { { engine.replacements_agreed() } -> std::convertible_to<int64_t>; }) {
    return engine.replacements_agreed();
  } else {
    return 0;
  }
}

/// At a step boundary inside an epoch, once checkpoints in flight are done: when the ranks agreed
/// to admit replacements, the engine leaves the fit to its elastic fit, which grows the group and
/// resumes from the step committed last (distributed/elastic/elastic_fit.hpp).
template <class Engine, class FinishCheckpoints>
void admit_agreed_replacements(Engine& engine, FinishCheckpoints&& finish_checkpoints) {
  if constexpr (requires { engine.admit_replacements(); }) {
    if (replacements_agreed(engine) == 0) return;
    finish_checkpoints();
    engine.admit_replacements();
  }
}

}  // namespace trainloop::detail
