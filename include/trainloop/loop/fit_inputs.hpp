#pragma once
/// @file
/// @brief What fit() checks before anything changes — the data, the callbacks, the precision — so
/// a call that cannot train fails at once, naming what is wrong, with the loop as it was.

#include <trainloop/callbacks/callback.hpp>
#include <trainloop/data/any_dataset.hpp>
#include <trainloop/detail/type_name.hpp>
#include <trainloop/engine/mode_engine.hpp>
#include <trainloop/error.hpp>
#include <trainloop/model_contract.hpp>
#include <trainloop/options.hpp>
#include <trainloop/precision/native_bf16.hpp>
#include <trainloop/precision/precision.hpp>

namespace trainloop::detail {

/// Checks fit()'s inputs: `options`, the training set `train` (there, and not empty), each of
/// `callbacks` (not null, and given batches it can change), and that the precision suits
/// `engine`'s device (fp16 needs CUDA; bf16 without the hardware is warned about once).
/// @throws trainloop::ConfigurationError naming the first input that cannot train.
template <class Batch, ModeEngine Engine>
void check_fit_inputs(Engine& engine, const TrainLoopOptions& options, const data::AnyDataset<Batch>& train,
                      const CallbackList& callbacks) {
  options.validate();
  TRAINLOOP_CHECK(train.has_value(), "fit() needs a training dataset");
  TRAINLOOP_CHECK(train.size() > 0, "the training dataset is empty; expected at least one sample");
  for (const auto& cb : callbacks) {
    TRAINLOOP_CHECK(cb != nullptr, "a null callback was given to fit()");
    TRAINLOOP_CHECK(is_example_batch_v<Batch> || !cb->needs_example_batches(), "callback ", cb->state_key(),
                    " changes batches in on_train_batch, which runs for torch::data::Example<> batches; this loop's "
                    "batches are ", readable_type_name<Batch>(), ". Expected Example batches for this callback");
  }
  TRAINLOOP_CHECK(options.precision() != Precision::fp16 || engine.device().is_cuda(), "precision is fp16 and the model "
                  "trains on ", engine.device().str(), "; expected a CUDA device for fp16 (use bf16 on the CPU)");
  warn_if_bf16_is_emulated(options.precision(), engine.device());
}

}  // namespace trainloop::detail
