#pragma once
/// @file
/// @brief An exported graph made runnable: each node resolved at load to an operator of
/// libtorch's dispatcher (ATen and prims only) with its arguments checked against the operator's
/// schema, then run node by node with boxed calls, so autograd records every operation and
/// backward works as in eager PyTorch. Symbolic sizes (torch.export.Dim) are bound from the
/// actual input and checked against their ranges; symbolic-int nodes (`aten.sym_size`, Python's
/// `operator.mul` ...) are evaluated here.
///
/// Train and eval from one graph: eval mode rewrites the training flags the training graph
/// recorded (interpreter/eval_mode_switch.hpp). Which operators a file may call at all:
/// interpreter/operator_policy.hpp.
///
/// Which intermediate values are alive: each is released after its last use, so a forward holds
/// what autograd saved and little else. A compiled node, running it and that plan:
/// interpreter/graph_step.hpp.

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/export/export_arguments.hpp>
#include <trainloop/serialization/export/export_graph.hpp>
#include <trainloop/interpreter/eval_mode_switch.hpp>
#include <trainloop/serialization/export/exported_input_sizes.hpp>
#include <trainloop/interpreter/graph_step.hpp>
#include <trainloop/interpreter/live_bytes.hpp>
#include <trainloop/interpreter/operator_policy.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/interpreter/symbolic_ints.hpp>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace trainloop::serialization {
TRAINLOOP_JSON_REFERENCES_BEGIN  // json_member's references: serialization/export/export_json.hpp

/// @brief A compiled program; see the file comment. Immutable once made, so replicas on several
/// threads share one.
class GraphProgram {
 public:
  /// @brief Resolves and checks every node of `graph`.
  /// @throws trainloop::CheckpointError naming the node for an operator that is not an ATen or
  ///         prims operator of this libtorch, a higher-order operator, arguments that do not match
  ///         its schema, a value used before it is made, or a mode that cannot be switched.
  explicit GraphProgram(const ExportGraph& graph) : program_(graph.program), input_sizes_(graph) {
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
    plan_releases(steps_, slot_count_, output_slot_, program_);
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
  /// @param memory_budget the bytes the values it makes may hold at once (default_memory_budget when unset)
  /// @throws trainloop::ConfigurationError when the input's sizes are not ones the program was
  ///         exported for; trainloop::CheckpointError naming the node when a value is not of the
  ///         kind its use takes, an argument fails its operator's check (operator_checks.hpp) or the
  ///         values pass the memory budget; c10::Error from an operator, with the node named in its context.
  torch::Tensor run(const std::vector<torch::Tensor>& state, const torch::Tensor& input, bool eval,
                    std::optional<int64_t> memory_budget = std::nullopt) const {
    input_sizes_.check(input);
    std::vector<c10::IValue> values(slot_count_);
    for (size_t i = 0; i < state_slots_.size() && i < state.size(); ++i) values[static_cast<size_t>(state_slots_[i])] = state[i];
    values[static_cast<size_t>(input_slot_)] = input;
    const c10::Device device = input.device();
    int64_t weight_bytes = 0;
    for (const auto& tensor : state) weight_bytes += tensor.defined() ? static_cast<int64_t>(tensor.nbytes()) : 0;
    const int64_t input_bytes = static_cast<int64_t>(input.nbytes());
    const int64_t budget = memory_budget ? *memory_budget : default_memory_budget(weight_bytes, input_bytes);
    auto budget_said = [&] {
      return trainloop::detail::concat("the program's memory budget of ", budget, " bytes",
                                       memory_budget ? std::string(" (set by the caller)")
                                                     : trainloop::detail::concat(" (1 GiB + 64 x its ", weight_bytes,
                                                                                 " bytes of weights + 4096 x its input's ",
                                                                                 input_bytes, ")"));
    };
    LiveBytes live;  // the storages the program's values hold beyond the weights and the input
    std::vector<c10::IValue> stack;
    for (const auto& step : steps_) {
      if (!(eval && step.skip_in_eval)) {
        stack.clear();
        try {
          for (const auto& argument : step.arguments) stack.push_back(make_argument(argument, values, device));
        } catch (const CheckpointError& error) {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", program_, " node ", quote_untrusted(step.node), ": ",
                                                          error.what()));
        }
        if (eval) {
          for (const auto& [index, value] : step.eval_arguments) stack[index] = value;
        }
        // What a node's results will hold, bounded from its arguments, is refused before its kernel
        // makes them: `full([2^40], 1.0)` or a broadcast of [N, 1] and [1, N] would otherwise
        // take the memory, then be named (operator_output_bytes.hpp).
        if (const int64_t bytes = step.bytes_to_allocate(stack); bytes > 0 && bytes > budget - live.bytes()) {
          throw CheckpointError(trainloop::detail::concat(
              "trainloop: ", program_, " node ", quote_untrusted(step.node), " (", quote_untrusted(step.target), ") would make ",
              bytes, " bytes of results, past ", budget_said(), " with ", live.bytes(), " bytes in use; expected a program of a ",
              "real model, or a larger budget: ExportedProgram::set_memory_budget"));
        }
        step.call(stack, program_);
        for (size_t r = 0; r < step.outputs.size() && r < stack.size(); ++r) step.outputs[r].store(stack[r], values, program_);
        for (const auto& output : step.outputs) {
          for (int slot : output.slots) live.add(values[static_cast<size_t>(slot)]);
        }
        if (live.bytes() > budget) {
          throw CheckpointError(trainloop::detail::concat(
              "trainloop: ", program_, " node ", quote_untrusted(step.node), " (", quote_untrusted(step.target), ") leaves ",
              live.bytes(), " bytes of values alive, over ", budget_said(),
              "; expected a program of a real model, or a larger budget: ExportedProgram::set_memory_budget"));
        }
      }
      for (int slot : step.release) {
        live.remove(values[static_cast<size_t>(slot)]);
        values[static_cast<size_t>(slot)] = c10::IValue();
      }
    }
    if (!values[static_cast<size_t>(output_slot_)].isTensor()) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", program_, "'s output is ",
                                                      values[static_cast<size_t>(output_slot_)].tagKind(),
                                                      "; expected a tensor"));
    }
    return values[static_cast<size_t>(output_slot_)].toTensor();
  }

  /// @brief The memory a run may hold in values the program makes, unless the caller sets one:
  /// 1 GiB + 64 x the weights + 4096 x the input. Generous for real models (an LM's logits are
  /// ~4x its head's weights at 16k tokens; a ResNet's largest activation ~5x its input), while a
  /// 2 KB program from a stranger that asks for 6 GiB (issue 50) is stopped at the node that does.
  static int64_t default_memory_budget(int64_t weight_bytes, int64_t input_bytes) {
    constexpr int64_t kBase = int64_t{1} << 30;
    const int64_t limit = std::numeric_limits<int64_t>::max() / 8;
    return kBase + std::min(weight_bytes, limit / 64) * 64 + std::min(input_bytes, limit / 4096) * 4096;
  }

 private:
  using StepKind = GraphStep::Kind;
  using Step = GraphStep;

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
      const std::string operation = node.target.substr(python.size());
      if (!is_symbolic_int_operation(operation)) {
        throw refuse(concat("is Python's operator.", quote_untrusted(operation), ", which trainloop does not evaluate; ",
                            "expected +, -, *, //, %, unary -, comparisons, and, or on symbolic ints"));
      }
      step.kind = StepKind::IntArithmetic;
      step.arithmetic = operation;
      compile_plain(step, node, operation == "neg" ? 1 : 2, where, lookup);
      return step;
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
      compile_plain(step, node, step.kind == StepKind::SymNumel || step.kind == StepKind::SymStorageOffset ? 1 : 2, where, lookup);
      if (step.arguments[0].kind != ArgumentRecipe::Kind::Value) throw refuse("does not take a tensor first");
      return step;
    }
    const auto handle = c10::Dispatcher::singleton().findSchema({full, overload == "default" ? "" : overload});
    const std::string never = detail::never_allowed_reason(space, op_name, overload);
    if (!never.empty()) throw refuse(concat("calls ", escape_untrusted(full), ", which ", never));
    if (!handle) {
      throw refuse(concat("calls ", escape_untrusted(full + "." + overload), ", which this libtorch (", TORCH_VERSION,
                          ") does not have; expected operators of the libtorch that trains it: export with the matching torch"));
    }
    const std::string refused = refused_operator_reason(space, op_name, overload);
    if (!refused.empty()) throw refuse(concat("calls ", full, ".", overload, ", which ", refused));
    step.op = *handle;
    step.check = operator_argument_check(full + "." + overload);
    step.output_bytes = operator_output_bytes(full + "." + overload);
    // Factories: a fresh tensor (no alias of an input, not a view) of the `size` they are given.
    const auto& returns = handle->schema().returns();
    const bool fresh = returns.size() == 1 && returns[0].alias_info() == nullptr && op_name.find("view") == std::string::npos;
    step.arange = op_name == "arange";
    for (size_t a = 0; fresh && a < handle->schema().arguments().size(); ++a) {
      const auto& argument = handle->schema().arguments()[a];
      const auto element = detail::list_element(detail::without_optional(argument.type()));
      if (argument.name() == "size" && element && detail::is_int_like(element)) step.size_argument = static_cast<int>(a);
    }
    const auto& schema = handle->schema();
    std::map<std::string, const nlohmann::json*> given;
    for (const auto& input : *node.inputs) {
      const std::string& name = json_string(json_member(input, "name", where), where + " input name");
      if (!given.emplace(name, &json_member(input, "arg", where)).second) throw refuse(concat("gives '", escape_untrusted(name), "' twice"));
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
    if (!given.empty()) throw refuse(concat("gives the argument '", escape_untrusted(given.begin()->first), "', which ", full, " does not take"));
    auto mode = eval_mode_switch(schema, step.arguments, op_name, buffers_, where);
    step.eval_arguments = std::move(mode.eval_arguments);
    step.skip_in_eval = mode.skip_in_eval;
    flags_on_ += mode.flags_on;
    flags_off_ += mode.flags_off;
    mode_dependent_ += mode.changes;
    compile_outputs(step, node, schema.returns().size(), where);
    return step;
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

  /// A step computed here: its arguments (symbolic ints, tensors, constants) and its one output.
  void compile_plain(Step& step, const ExportNode& node, size_t arguments, const std::string& where, const SlotLookup& lookup) {
    for (const auto& input : *node.inputs) step.arguments.push_back(plain_argument_recipe(input, where, lookup));
    if (step.arguments.size() != arguments) {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has ", step.arguments.size(),
                                                      " arguments; expected ", arguments));
    }
    compile_outputs(step, node, 1, where);
  }

  std::string program_;
  ExportedInputSizes input_sizes_;
  std::unordered_map<std::string, int> slots_;
  size_t slot_count_ = 0;
  std::vector<int> state_slots_;
  std::map<int, std::string> buffers_;  // slot -> buffer name
  int input_slot_ = -1, output_slot_ = -1;
  std::vector<Step> steps_;
  size_t mode_dependent_ = 0, flags_on_ = 0, flags_off_ = 0;
};

TRAINLOOP_JSON_REFERENCES_END
}  // namespace trainloop::serialization
