#pragma once
/// @file
/// @brief Everything one fit() call owns while it runs, in one object: the FitRunner creates it
/// when the call starts, the epochs read and update it, a checkpoint written inside the call reads
/// the current epoch's sums from it, and it ends with the call. Nothing of it outlives fit().

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/detail/stopwatch.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/history.hpp>
#include <trainloop/loop/epoch_batch_plan.hpp>
#include <trainloop/metrics/metric_accumulator.hpp>
#include <trainloop/precision/grad_scaler.hpp>
#include <trainloop/progress/progress_beacon.hpp>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::detail {

/// One fit() call's state (see the file comment). Not movable once made: the TrainState's
/// `history` points at `visible`.
struct FitRun {
  FitRun(DataShard data_shard, EpochBatchPlan epoch_plan) : shard(data_shard), full_plan(std::move(epoch_plan)) {}
  FitRun(const FitRun&) = delete;
  FitRun& operator=(const FitRun&) = delete;

  DataShard shard;              ///< which part of the training set this process reads
  EpochBatchPlan full_plan;     ///< the micro-batches of a whole epoch (an epoch from its start follows it)
  CallbackList active;          ///< the callbacks that run on this process, in call order
  std::vector<std::string> active_names;  ///< their state keys, as the stall watchdog names them
  int64_t end_step = 0;         ///< the global step at which the call ends (max without a step count)
  int64_t end_epoch = 0;        ///< the epoch after which the call ends (max when fitting by steps)
  TrainState state;             ///< what callbacks see
  History visible;              ///< the History callbacks see (state.history points here)
  Stopwatch clock;              ///< since the call started
  std::optional<GradScaler> scaler;              ///< fp16's loss scaler
  std::optional<MetricAccumulator> epoch_sums;   ///< the current epoch's sums, while it trains
  /// Before the optimizer step: waits for a checkpoint written behind training to hold its copy.
  std::function<void()> await_checkpoint_capture;
  /// At each step boundary: reports a checkpoint written behind training once the ranks agree it ended.
  std::function<void()> poll_checkpoints;
  /// At the start of each accumulation window (`epoch_start`: the epoch's first): elastic training's
  /// copies of sharded state (a collective), then, inside an epoch, replacements the ranks agreed to
  /// admit (engine/step_commit.hpp).
  std::function<void(bool epoch_start)> at_window_start;
};

/// Calls `hook_call(callback)` for every active callback in order, each in the phase "callback"
/// named "<its state key>::<hook>" (what a stall report says a rank is stuck in); a callback of the
/// main process only (files, plots) in its own phase, which the other ranks wait out.
template <class HookCall>
void notify_callbacks(FitRun& run, const char* hook, HookCall&& hook_call) {
  for (std::size_t i = 0; i < run.active.size(); ++i) {
    progress::PhaseScope phase(run.active[i]->main_process_only() ? progress::Phase::MainOnlyCallback
                                                                  : progress::Phase::Callback,
                               run.active_names[i].c_str(), hook);
    hook_call(*run.active[i]);
  }
}

/// What the History records as the reason of a stop all ranks agreed on: this rank's callback's
/// reason, or that a callback on another rank asked (the reason text stays on that rank).
inline std::string agreed_stop_reason(const TrainState& state) {
  return state.stop_reason.empty() ? "a callback on another rank asked to stop" : state.stop_reason;
}

}  // namespace trainloop::detail
