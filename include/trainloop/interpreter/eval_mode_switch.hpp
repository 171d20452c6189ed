#pragma once
/// @file
/// @brief How eval mode differs from train mode for one node of an exported graph.
///
/// torch.export's default graph ("training IR") records the mode the model was in. Eval mode is
/// made by rewriting the known training flags (batch_norm's `training`, the dropouts' `train`) to
/// false — unless a BatchNorm keeps no running statistics, which normalizes with the batch's in
/// eval too, as in Python — and by skipping the in-place `num_batches_tracked` increments; running
/// statistics then stay as they are, as in Python's eval(). A node whose mode trainloop cannot
/// switch (another operator's training flag, another buffer written in place) is refused at load,
/// naming it; so is any in-place write into a constant of the program (shared by every run and
/// every DataParallel replica).

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_arguments.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief What eval mode changes in one node.
struct EvalModeSwitch {
  std::vector<std::pair<size_t, c10::IValue>> eval_arguments;  ///< (argument index, value in eval mode)
  bool skip_in_eval = false;  ///< the node does not run in eval mode (a num_batches_tracked increment)
  size_t flags_on = 0;        ///< training flags exported true
  size_t flags_off = 0;       ///< training flags exported false
  size_t changes = 0;         ///< flags switched plus increments skipped
};

/// @brief Decides what eval mode changes in node `where`, calling `op_name` (the operator's name
/// without namespace) with `arguments_given` (in `schema`'s order); `buffers` maps the slots of
/// the graph's buffers to their names.
/// @throws trainloop::CheckpointError naming the node when its mode cannot be switched, or when it
///         writes a constant in place.
inline EvalModeSwitch eval_mode_switch(const c10::FunctionSchema& schema, const std::vector<ArgumentRecipe>& arguments_given,
                                       const std::string& op_name, const std::map<int, std::string>& buffers,
                                       const std::string& where) {
  using trainloop::detail::concat;
  EvalModeSwitch result;
  static const std::map<std::string, std::string> flags = {
      {"batch_norm", "training"},    {"native_batch_norm", "training"},   {"_native_batch_norm_legit", "training"},
      {"dropout", "train"},          {"feature_dropout", "train"},        {"alpha_dropout", "train"},
      {"feature_alpha_dropout", "train"}, {"native_dropout", "train"}};
  const auto known = flags.find(op_name);
  const auto& arguments = schema.arguments();
  // Python's BatchNorm normalizes with the batch's statistics in eval too when it keeps none
  // (track_running_stats=False: running_mean and running_var are None).
  bool without_running_stats = false;
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (arguments[i].name() == "running_mean" && arguments_given[i].kind == ArgumentRecipe::Kind::Constant &&
        arguments_given[i].constant.isNone()) {
      without_running_stats = true;
    }
  }
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& name = arguments[i].name();
    if (name != "train" && name != "training") continue;
    if (known == flags.end() || known->second != name || arguments_given[i].kind != ArgumentRecipe::Kind::Constant) {
      throw CheckpointError(concat("trainloop: ", where, " has a training flag '", name, "' that trainloop does not know "
                                   "how to switch for eval mode; expected only batch_norm's and the dropouts' flags as constants"));
    }
    const auto& flag = arguments_given[i].constant;
    (flag.isBool() && flag.toBool() ? result.flags_on : result.flags_off) += 1;
    if (without_running_stats) continue;
    result.eval_arguments.emplace_back(i, c10::IValue(false));
    ++result.changes;
  }
  // In-place writes: never into a constant of the program (shared by every run and replica);
  // into buffers only BatchNorm's (its running statistics, whose update its training flag
  // decides, and num_batches_tracked += 1, not done in eval).
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto* alias = arguments[i].alias_info();
    if (!alias || !alias->isWrite()) continue;
    if (arguments_given[i].kind == ArgumentRecipe::Kind::Constant && !arguments_given[i].constant.isNone()) {
      throw CheckpointError(concat("trainloop: ", where, " writes its argument '", arguments[i].name(), "' in place, ",
                                   "which is a constant of the program; expected in-place operators on graph values only"));
    }
    if (arguments_given[i].kind != ArgumentRecipe::Kind::Value) continue;
    const auto buffer = buffers.find(arguments_given[i].slot);
    if (buffer == buffers.end()) continue;
    const bool running_stat = known != flags.end() && known->second == "training" &&
                              (arguments[i].name() == "running_mean" || arguments[i].name() == "running_var");
    if (running_stat) continue;
    const std::string counter = "num_batches_tracked";
    const bool increment = op_name == "add_" && buffer->second.size() >= counter.size() &&
                           buffer->second.compare(buffer->second.size() - counter.size(), counter.size(), counter) == 0;
    if (!increment) {
      throw CheckpointError(concat(
          "trainloop: ", where, " writes the buffer ", quote_untrusted(buffer->second), " in place, and trainloop cannot ",
          "tell whether eval mode would; expected buffer writes only by BatchNorm (its running statistics and ",
          "num_batches_tracked)"));
    }
    result.skip_in_eval = true;
    ++result.changes;
  }
  return result;
}

}  // namespace trainloop::serialization
