#pragma once
/// @file
/// @brief An exported graph made runnable: each node resolved at load to an operator of
/// libtorch's dispatcher (ATen and prims only) with its arguments checked against the operator's
/// schema, then run node by node with boxed calls, so autograd records every operation and
/// backward works as in eager PyTorch. Symbolic sizes (torch.export.Dim) are bound from the
/// actual input and checked against their ranges; symbolic-int nodes (`aten.sym_size`, Python's
/// `operator.mul` ...) are evaluated here.
///
/// Train and eval from one graph: the default export ("training IR") records the mode the
/// model was in. Eval mode is made by rewriting the known training flags (batch_norm's
/// `training`, the dropouts' `train`) to false and skipping the in-place `num_batches_tracked`
/// increments; running statistics then stay as they are, as in Python's eval(). A node whose
/// mode trainloop cannot switch (another training flag, another buffer mutation) is refused at
/// load, naming it.
///
/// Which intermediate values are alive: each is released after its last use, so a forward holds
/// what autograd saved and little else.

#include <trainloop/error.hpp>
#include <trainloop/serialization/export_arguments.hpp>
#include <trainloop/serialization/export_graph.hpp>
#include <trainloop/serialization/operator_policy.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief A compiled program; see the file comment. Immutable once made, so replicas on several
/// threads share one.
class GraphProgram {
 public:
  /// @brief Resolves and checks every node of `graph`.
  /// @throws trainloop::CheckpointError naming the node for an operator that is not an ATen or
  ///         prims operator of this libtorch, a higher-order operator, arguments that do not match
  ///         its schema, a value used before it is made, or a mode that cannot be switched.
  explicit GraphProgram(const ExportGraph& graph) : program_(graph.program), dims_(graph.input_dims), ranges_(graph.ranges) {
    for (const auto& input : graph.inputs) {
      const int slot = define(input.graph_name);
      if (input.kind == ExportInput::Kind::UserInput) {
        input_slot_ = slot;
      } else {
        state_slots_.push_back(slot);
        if (input.kind == ExportInput::Kind::Buffer) buffers_.emplace(slot, input.target);
      }
    }
    for (const auto& node : graph.nodes) steps_.push_back(compile(node));
    output_slot_ = slot_of(graph.output, "its output");
    plan_releases();
  }

  /// The program, for messages ("<file>'s program 'model'").
  const std::string& name() const { return program_; }
  /// Nodes whose behaviour eval mode changes (training flags switched, increments skipped).
  size_t mode_dependent_nodes() const { return mode_dependent_; }
  /// True when the graph was exported in eval mode: every training flag it has is false.
  bool exported_in_eval_mode() const { return flags_on_ == 0 && flags_off_ > 0; }

  /// @brief Runs the program.
  /// @param state the parameters, buffers and constants, in the graph's placeholder order
  /// @param input the one user input
  /// @param eval run in eval mode (see the file comment)
  /// @return the output
  /// @throws trainloop::ConfigurationError when the input's sizes are not ones the program was
  ///         exported for; c10::Error from an operator, with the node named in its context.
  torch::Tensor run(const std::vector<torch::Tensor>& state, const torch::Tensor& input, bool eval) const {
    check_input(input);
    std::vector<c10::IValue> values(slot_count_);
    for (size_t i = 0; i < state_slots_.size() && i < state.size(); ++i) values[static_cast<size_t>(state_slots_[i])] = state[i];
    values[static_cast<size_t>(input_slot_)] = input;
    const c10::Device device = input.device();
    std::vector<c10::IValue> stack;
    for (const auto& step : steps_) {
      if (!(eval && step.skip_in_eval)) {
        stack.clear();
        for (const auto& argument : step.arguments) stack.push_back(make_argument(argument, values, device));
        if (eval) {
          for (const auto& [index, value] : step.eval_arguments) stack[index] = value;
        }
        call(step, stack);
        for (size_t r = 0; r < step.outputs.size() && r < stack.size(); ++r) store(step.outputs[r], stack[r], values);
      }
      for (int slot : step.release) values[static_cast<size_t>(slot)] = c10::IValue();
    }
    return values[static_cast<size_t>(output_slot_)].toTensor();
  }

 private:
  /// What a step is: a dispatcher call, or a symbolic-int computation done here.
  enum class StepKind { Operator, SymSize, SymNumel, SymStride, SymStorageOffset, IntArithmetic };

  /// Where a return value goes: one slot, or a list's elements (Tensor[] returns).
  struct OutputTarget {
    std::vector<int> slots;  ///< empty: unused; one: the value; several (or list=true): the list's elements
    bool list = false;       ///< the return is a list
  };

  struct Step {
    StepKind kind = StepKind::Operator;
    std::string node, target;
    std::optional<c10::OperatorHandle> op;
    std::string arithmetic;                                    // for IntArithmetic: "mul", "add", ...
    std::vector<ArgumentRecipe> arguments;
    std::vector<std::pair<size_t, c10::IValue>> eval_arguments;  // replaced in eval mode
    bool skip_in_eval = false;
    std::vector<OutputTarget> outputs;
    std::vector<int> release;                                  // slots last used here
  };

  int define(const std::string& name) {
    if (!slots_.emplace(name, static_cast<int>(slot_count_)).second) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", program_, " defines the value ", quote_untrusted(name),
                                                      " twice; expected each value made once"));
    }
    return static_cast<int>(slot_count_++);
  }

  int slot_of(const std::string& name, const std::string& user) const {
    const auto found = slots_.find(name);
    if (found == slots_.end()) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", program_, " uses the value ", quote_untrusted(name),
                                                      " in ", user, " before any node makes it; expected nodes in order"));
    }
    return found->second;
  }

  static std::pair<std::string, std::string> split_operator(const std::string& qualified) {
    const auto dot = qualified.rfind('.');
    return {qualified.substr(0, dot), dot == std::string::npos ? std::string() : qualified.substr(dot + 1)};
  }

  Step compile(const ExportNode& node) {
    using trainloop::detail::concat;
    Step step;
    step.node = node.name;
    step.target = node.target;
    const std::string where = concat(program_, " node ", quote_untrusted(node.name), " (", quote_untrusted(node.target), ")");
    auto refuse = [&](const std::string& why) { return CheckpointError(concat("trainloop: ", where, " ", why)); };
    const SlotLookup lookup = [&](const std::string& name) { return slot_of(name, "node " + quote_untrusted(node.name)); };
    const std::string ops = "torch.ops.";
    if (node.target.compare(0, ops.size(), ops) != 0) {
      const std::string python = "_operator.";
      if (node.target.compare(0, python.size(), python) != 0) {
        throw refuse("is neither an operator of torch.ops nor Python's operator module; expected ATen operators only");
      }
      return compile_arithmetic(std::move(step), node, node.target.substr(python.size()), where, lookup);
    }
    const std::string qualified = node.target.substr(ops.size());  // aten.conv2d.default
    const auto first_dot = qualified.find('.');
    const std::string space = qualified.substr(0, first_dot);
    if (space == "higher_order") {
      throw refuse("is a higher-order operator (control flow or a wrapped subgraph: cond, while_loop, map, wrap_with_*), "
                   "which trainloop does not run; expected a graph of ATen operators: export the model without "
                   "torch.cond/while_loop, and without autocast or no_grad regions inside forward");
    }
    if (space != "aten" && space != "prims") {
      throw refuse(concat("calls an operator of the namespace ", quote_untrusted(space), "; expected ATen or prims "
                          "operators only (custom torch.ops libraries are not loaded from a file)"));
    }
    auto [op_name, overload] = split_operator(qualified.substr(first_dot + 1));
    if (op_name.empty() || overload.empty()) throw refuse("does not name operator.overload");
    const std::string full = space + "::" + op_name;
    if (full == "aten::sym_size" || full == "aten::sym_numel" || full == "aten::sym_stride" || full == "aten::sym_storage_offset") {
      step.kind = full == "aten::sym_size"     ? StepKind::SymSize
                  : full == "aten::sym_numel"  ? StepKind::SymNumel
                  : full == "aten::sym_stride" ? StepKind::SymStride
                                               : StepKind::SymStorageOffset;
      compile_positional(step, node, where, lookup);
      return step;
    }
    const std::string refused = refused_operator_reason(space, op_name);
    if (!refused.empty()) throw refuse(concat("calls ", full, ", which ", refused));
    const auto handle = c10::Dispatcher::singleton().findSchema({full, overload == "default" ? "" : overload});
    if (!handle) {
      throw refuse(concat("calls ", full, ".", overload, ", which this libtorch (", TORCH_VERSION,
                          ") does not have; expected operators of the libtorch that trains it: export with the matching torch"));
    }
    step.op = *handle;
    const auto& schema = handle->schema();
    std::map<std::string, const nlohmann::json*> given;
    for (const auto& input : *node.inputs) {
      const std::string& name = json_string(json_member(input, "name", where), where + " input name");
      if (!given.emplace(name, &json_member(input, "arg", where)).second) throw refuse(concat("gives '", name, "' twice"));
    }
    for (const auto& argument : schema.arguments()) {
      const auto found = given.find(argument.name());
      if (found != given.end()) {
        step.arguments.push_back(make_argument_recipe(*found->second, argument, where, lookup));
        given.erase(found);
      } else if (argument.default_value()) {
        step.arguments.push_back(ArgumentRecipe{ArgumentRecipe::Kind::Constant, *argument.default_value(), -1, {}, {}});
      } else {
        throw refuse(concat("does not give the argument '", argument.name(), "', which ", full, " requires"));
      }
    }
    if (!given.empty()) throw refuse(concat("gives the argument '", given.begin()->first, "', which ", full, " does not take"));
    switch_mode(step, schema, op_name, where);
    compile_outputs(step, node, schema.returns().size(), where);
    return step;
  }

  /// Records how eval mode differs for this node, or refuses one that cannot be switched.
  void switch_mode(Step& step, const c10::FunctionSchema& schema, const std::string& op_name, const std::string& where) {
    using trainloop::detail::concat;
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
      if (arguments[i].name() == "running_mean" && step.arguments[i].kind == ArgumentRecipe::Kind::Constant &&
          step.arguments[i].constant.isNone()) {
        without_running_stats = true;
      }
    }
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto& name = arguments[i].name();
      if (name != "train" && name != "training") continue;
      if (known == flags.end() || known->second != name || step.arguments[i].kind != ArgumentRecipe::Kind::Constant) {
        throw CheckpointError(concat("trainloop: ", where, " has a training flag '", name, "' that trainloop does not know "
                                     "how to switch for eval mode; expected only batch_norm's and the dropouts' flags as constants"));
      }
      const auto& flag = step.arguments[i].constant;
      (flag.isBool() && flag.toBool() ? flags_on_ : flags_off_) += 1;
      if (without_running_stats) continue;
      step.eval_arguments.emplace_back(i, c10::IValue(false));
      ++mode_dependent_;
    }
    // In-place writes: never into a constant of the program (shared by every run and replica);
    // into buffers only BatchNorm's (its running statistics, whose update its training flag
    // decides, and num_batches_tracked += 1, not done in eval).
    for (size_t i = 0; i < arguments.size(); ++i) {
      const auto* alias = arguments[i].alias_info();
      if (!alias || !alias->isWrite()) continue;
      if (step.arguments[i].kind == ArgumentRecipe::Kind::Constant && !step.arguments[i].constant.isNone()) {
        throw CheckpointError(concat("trainloop: ", where, " writes its argument '", arguments[i].name(), "' in place, ",
                                     "which is a constant of the program; expected in-place operators on graph values only"));
      }
      if (step.arguments[i].kind != ArgumentRecipe::Kind::Value) continue;
      const auto buffer = buffers_.find(step.arguments[i].slot);
      if (buffer == buffers_.end()) continue;
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
      step.skip_in_eval = true;
      ++mode_dependent_;
    }
  }

  void compile_outputs(Step& step, const ExportNode& node, size_t returns, const std::string& where) {
    auto bad = [&]() {
      return CheckpointError(trainloop::detail::concat("trainloop: ", where, " has ", node.outputs->size(), " outputs for ",
                                                       returns, " returns of its operator; expected one per return"));
    };
    const auto& outputs = *node.outputs;
    const bool packed = outputs.size() == 1 && returns > 1;  // several returns written as one as_tensors
    if (!packed && outputs.size() != returns) throw bad();
    step.outputs.resize(returns);
    auto names = [&](const nlohmann::json& list) {
      std::vector<int> out;
      for (const auto& item : list) out.push_back(define(json_string(json_member(item, "name", where), where + " output")));
      return out;
    };
    if (packed) {
      auto [kind, value] = json_union(outputs[0], where + " output");
      if (kind != "as_tensors" || !value->is_array() || value->size() != returns) throw bad();
      const auto slots = names(*value);
      for (size_t r = 0; r < returns; ++r) step.outputs[r].slots = {slots[r]};
      return;
    }
    for (size_t r = 0; r < returns; ++r) {
      auto [kind, value] = json_union(outputs[r], where + " output");
      if (kind == "as_tensor") {
        step.outputs[r].slots = {define(json_string(json_member(*value, "name", where), where + " output"))};
      } else if (kind == "as_tensors") {
        if (!value->is_array()) throw bad();
        step.outputs[r].slots = names(*value);
        step.outputs[r].list = true;
      } else if (kind == "as_sym_int" || kind == "as_sym_bool") {
        auto [sym_kind, sym_value] = json_union(*value, where + " output");
        if (sym_kind == "as_name") step.outputs[r].slots = {define(json_string(*sym_value, where + " output"))};
      } else if (kind != "as_none") {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has an output of kind ", quote_untrusted(kind),
                                                        "; expected tensors, tensor lists or symbolic ints"));
      }
    }
  }

  /// Arguments of the steps computed here: a tensor or symbolic int (a Value), or a constant int.
  void compile_positional(Step& step, const ExportNode& node, const std::string& where, const SlotLookup& lookup) {
    for (const auto& input : *node.inputs) {
      auto [kind, value] = json_union(json_member(input, "arg", where), where + " argument");
      ArgumentRecipe recipe;
      if (kind == "as_int") {
        recipe.constant = json_int(*value, where);
      } else if (kind == "as_tensor") {
        recipe.kind = ArgumentRecipe::Kind::Value;
        recipe.slot = lookup(json_string(json_member(*value, "name", where), where));
      } else if (kind == "as_sym_int" || kind == "as_sym_bool") {
        auto [sym_kind, sym_value] = json_union(*value, where);
        if (sym_kind == "as_name") {
          recipe.kind = ArgumentRecipe::Kind::Value;
          recipe.slot = lookup(json_string(*sym_value, where));
        } else if (sym_kind == "as_int") {
          recipe.constant = json_int(*sym_value, where);
        } else {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has a symbolic argument of kind ", sym_kind));
        }
      } else if (kind == "as_bool" && value->is_boolean()) {
        recipe.constant = value->get<bool>();
      } else {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has an argument of kind ", quote_untrusted(kind),
                                                        "; expected tensors and (symbolic) ints"));
      }
      step.arguments.push_back(std::move(recipe));
    }
    const size_t wanted = step.kind == StepKind::SymNumel || step.kind == StepKind::SymStorageOffset ? 1 : 2;
    if (step.arguments.size() != wanted || step.arguments[0].kind != ArgumentRecipe::Kind::Value) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has ", step.arguments.size(),
                                                      " arguments; expected a tensor", wanted == 2 ? " and a dimension" : ""));
    }
    compile_outputs(step, node, 1, where);
  }

  Step compile_arithmetic(Step step, const ExportNode& node, const std::string& operation, const std::string& where,
                          const SlotLookup& lookup) {
    static const char* known[] = {"add", "sub", "mul", "floordiv", "mod", "neg", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_"};
    bool found = false;
    for (const char* name : known) found = found || operation == name;
    if (!found) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " is Python's operator.", quote_untrusted(operation),
                                                      ", which trainloop does not evaluate; expected +, -, *, //, %, unary -, "
                                                      "comparisons, and, or on symbolic ints"));
    }
    step.kind = StepKind::IntArithmetic;
    step.arithmetic = operation;
    for (const auto& input : *node.inputs) {
      auto [kind, value] = json_union(json_member(input, "arg", where), where + " argument");
      ArgumentRecipe recipe;
      if (kind == "as_int") {
        recipe.constant = json_int(*value, where);
      } else if (kind == "as_bool" && value->is_boolean()) {
        recipe.constant = value->get<bool>();
      } else if (kind == "as_sym_int" || kind == "as_sym_bool") {
        auto [sym_kind, sym_value] = json_union(*value, where);
        if (sym_kind != "as_name") {
          recipe.constant = sym_value->is_boolean() ? c10::IValue(sym_value->get<bool>()) : c10::IValue(json_int(*sym_value, where));
        } else {
          recipe.kind = ArgumentRecipe::Kind::Value;
          recipe.slot = lookup(json_string(*sym_value, where));
        }
      } else {
        throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has an argument of kind ", quote_untrusted(kind),
                                                        "; expected symbolic ints"));
      }
      step.arguments.push_back(std::move(recipe));
    }
    if (step.arguments.size() != (operation == "neg" ? 1u : 2u)) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has ", step.arguments.size(), " arguments"));
    }
    compile_outputs(step, node, 1, where);
    return step;
  }

  /// Releases each slot after its last use (never the output).
  void plan_releases() {
    std::vector<int> last(slot_count_, -1);
    for (size_t s = 0; s < steps_.size(); ++s) {
      for (const auto& argument : steps_[s].arguments) {
        if (argument.slot >= 0) last[static_cast<size_t>(argument.slot)] = static_cast<int>(s);
        for (int slot : argument.slots) {
          if (slot >= 0) last[static_cast<size_t>(slot)] = static_cast<int>(s);
        }
      }
      for (const auto& output : steps_[s].outputs) {
        for (int slot : output.slots) {
          if (last[static_cast<size_t>(slot)] < 0) last[static_cast<size_t>(slot)] = static_cast<int>(s);  // unused: free at once
          if (steps_[s].skip_in_eval && used_later(slot, s)) {
            throw CheckpointError(trainloop::detail::concat("trainloop: ", program_, " node ", quote_untrusted(steps_[s].node),
                                                            " is skipped in eval mode but its result is used later"));
          }
        }
      }
    }
    for (size_t slot = 0; slot < slot_count_; ++slot) {
      if (last[slot] >= 0 && static_cast<int>(slot) != output_slot_) steps_[static_cast<size_t>(last[slot])].release.push_back(static_cast<int>(slot));
    }
  }

  bool used_later(int slot, size_t after) const {
    for (size_t s = after + 1; s < steps_.size(); ++s) {
      for (const auto& argument : steps_[s].arguments) {
        if (argument.slot == slot) return true;
        for (int used : argument.slots) {
          if (used == slot) return true;
        }
      }
    }
    return slot == output_slot_;
  }

  void call(const Step& step, std::vector<c10::IValue>& stack) const {
    if (step.kind == StepKind::Operator) {
      try {
        step.op->callBoxed(stack);
      } catch (c10::Error& error) {
        error.add_context(trainloop::detail::concat("trainloop: while running node ", step.node, " (", step.target, ") of ", program_));
        throw;
      }
      return;
    }
    if (step.kind == StepKind::IntArithmetic) {
      stack = {arithmetic(step.arithmetic, stack)};
      return;
    }
    const auto& tensor = stack[0].toTensor();
    int64_t result = 0;
    if (step.kind == StepKind::SymNumel) {
      result = tensor.numel();
    } else if (step.kind == StepKind::SymStorageOffset) {
      result = tensor.storage_offset();
    } else {
      const int64_t dim = c10::maybe_wrap_dim(stack[1].toInt(), tensor.dim());
      result = step.kind == StepKind::SymSize ? tensor.size(dim) : tensor.stride(dim);
    }
    stack = {c10::IValue(result)};
  }

  /// Python's int arithmetic on 64 bits; what would overflow is an error, not undefined behaviour.
  static c10::IValue arithmetic(const std::string& operation, const std::vector<c10::IValue>& arguments) {
    auto number = [](const c10::IValue& value) { return value.isBool() ? int64_t(value.toBool()) : value.toInt(); };
    const int64_t a = number(arguments[0]), b = arguments.size() > 1 ? number(arguments[1]) : 0;
    int64_t result = 0;
    bool overflow = false;
    if (operation == "neg") {
      overflow = __builtin_sub_overflow(int64_t{0}, a, &result);
    } else if (operation == "add") {
      overflow = __builtin_add_overflow(a, b, &result);
    } else if (operation == "sub") {
      overflow = __builtin_sub_overflow(a, b, &result);
    } else if (operation == "mul") {
      overflow = __builtin_mul_overflow(a, b, &result);
    } else if (operation == "floordiv" || operation == "mod") {
      TORCH_CHECK(b != 0, "trainloop: a symbolic size divides by zero (operator.", operation, ")");
      TORCH_CHECK(!(a == std::numeric_limits<int64_t>::min() && b == -1), "trainloop: a symbolic size overflows 64 bits (operator.",
                  operation, ")");
      const int64_t quotient = a / b - ((a % b != 0) && ((a < 0) != (b < 0)) ? 1 : 0);  // Python's floor division
      result = operation == "floordiv" ? quotient : a - quotient * b;
    } else if (operation == "eq") {
      return a == b;
    } else if (operation == "ne") {
      return a != b;
    } else if (operation == "lt") {
      return a < b;
    } else if (operation == "le") {
      return a <= b;
    } else if (operation == "gt") {
      return a > b;
    } else if (operation == "ge") {
      return a >= b;
    } else if (operation == "and_") {
      return (a != 0) && (b != 0);
    } else {
      return (a != 0) || (b != 0);  // or_
    }
    TORCH_CHECK(!overflow, "trainloop: a symbolic size overflows 64 bits (operator.", operation, " of ", a, " and ", b, ")");
    return result;
  }

  void store(const OutputTarget& target, c10::IValue& value, std::vector<c10::IValue>& values) const {
    if (target.slots.empty()) return;
    if (!target.list) {
      values[static_cast<size_t>(target.slots[0])] = std::move(value);
      return;
    }
    const auto list = value.toTensorList();
    TORCH_CHECK(list.size() == target.slots.size(), "trainloop: ", program_, ": an operator returned ", list.size(),
                " tensors where the graph names ", target.slots.size());
    for (size_t i = 0; i < target.slots.size(); ++i) values[static_cast<size_t>(target.slots[i])] = list.get(i);
  }

  /// Checks the input against the exported sizes: fixed ones equal, symbols consistent and in range.
  void check_input(const torch::Tensor& input) const {
    using trainloop::detail::concat;
    auto exported = [&] {
      std::string text = "[";
      for (size_t d = 0; d < dims_.size(); ++d) {
        text += (d ? ", " : "") + (dims_[d].fixed ? std::to_string(*dims_[d].fixed) : dims_[d].symbol.empty() ? dims_[d].expression : dims_[d].symbol);
      }
      return text + "]";
    };
    if (static_cast<size_t>(input.dim()) != dims_.size()) {
      throw ConfigurationError(concat("trainloop: the input of ", program_, " has ", input.dim(), " dimensions ",
                                      input.sizes(), "; expected ", dims_.size(), ", as exported: ", exported()));
    }
    std::map<std::string, int64_t> bound;
    for (size_t d = 0; d < dims_.size(); ++d) {
      const int64_t size = input.size(static_cast<int64_t>(d));
      const auto& dim = dims_[d];
      if (dim.fixed && *dim.fixed != size) {
        throw ConfigurationError(concat(
            "trainloop: the input of ", program_, " has size ", size, " in dimension ", d, "; expected ", *dim.fixed,
            ": the program was exported with that size fixed (sizes ", exported(), "). Export it with a dynamic size, "
            "torch.export.export(model, (x,), dynamic_shapes=({", d, ": torch.export.Dim(\"batch\")},))",
            d == 0 ? ", or train with drop_last so that every batch has that size (also in evaluation)" : ""));
      }
      if (dim.symbol.empty() || dim.fixed) continue;
      const auto [previous, fresh] = bound.emplace(dim.symbol, size);
      if (!fresh && previous->second != size) {
        throw ConfigurationError(concat("trainloop: the input of ", program_, " has sizes ", input.sizes(), "; expected ",
                                        "equal sizes wherever the export has the symbol ", dim.symbol, ": ", exported()));
      }
      const auto range = ranges_.find(dim.symbol);
      if (range != ranges_.end() && (size < range->second.min || (range->second.max && size > *range->second.max))) {
        throw ConfigurationError(concat("trainloop: the input of ", program_, " has size ", size, " in dimension ", d,
                                        "; expected ", range->second.min, " to ",
                                        range->second.max ? std::to_string(*range->second.max) : std::string("any size"),
                                        " (the range of its torch.export.Dim ", dim.symbol, ")"));
      }
    }
  }

  std::string program_;
  std::vector<ExportDim> dims_;
  std::map<std::string, SymbolRange> ranges_;
  std::unordered_map<std::string, int> slots_;
  size_t slot_count_ = 0;
  std::vector<int> state_slots_;
  std::map<int, std::string> buffers_;  // slot -> buffer name
  int input_slot_ = -1, output_slot_ = -1;
  std::vector<Step> steps_;
  size_t mode_dependent_ = 0, flags_on_ = 0, flags_off_ = 0;
};

}  // namespace trainloop::serialization
