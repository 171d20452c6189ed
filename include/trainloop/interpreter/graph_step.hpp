#pragma once
/// @file
/// @brief One node of a GraphProgram (interpreter/graph_program.hpp), compiled: what it calls (an
/// operator of libtorch's dispatcher, or a symbolic-int computation done here), how its arguments
/// are made, what eval mode changes in it, where its results go and which values die after it;
/// running it on a boxed stack; and the plan that releases each value after its last use, so a
/// forward holds what autograd saved and little else.

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_arguments.hpp>
#include <trainloop/interpreter/operator_checks.hpp>
#include <trainloop/interpreter/operator_output_bytes.hpp>
#include <trainloop/serialization/quoted.hpp>
#include <trainloop/interpreter/symbolic_ints.hpp>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/torch.h>

#include <cstddef>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization {

/// @brief Where one return value of a GraphStep goes: one slot, or a list's elements (Tensor[]
/// returns).
struct GraphOutputTarget {
  std::vector<int> slots;  ///< empty: unused; one: the value; several (or list=true): the list's elements
  bool list = false;       ///< the return is a list

  /// Stores `value`, a return of a step of `program` (named for messages), in its slots of `values`.
  void store(c10::IValue& value, std::vector<c10::IValue>& values, const std::string& program) const {
    if (slots.empty()) return;
    if (!list) {
      values[static_cast<size_t>(slots[0])] = std::move(value);
      return;
    }
    const auto returned = value.toTensorList();
    TORCH_CHECK(returned.size() == slots.size(), "trainloop: ", program, ": an operator returned ", returned.size(),
                " tensors where the graph names ", slots.size());
    for (size_t i = 0; i < slots.size(); ++i) values[static_cast<size_t>(slots[i])] = returned.get(i);
  }
};

/// @brief One node of a GraphProgram, compiled (see the file comment).
struct GraphStep {
  /// @brief What a step is: a dispatcher call, or a symbolic-int computation done here.
  enum class Kind {
    Operator,          ///< a call of `op`
    SymSize,           ///< `aten.sym_size`: a tensor's size in a dimension
    SymNumel,          ///< `aten.sym_numel`: a tensor's element count
    SymStride,         ///< `aten.sym_stride`: a tensor's stride in a dimension
    SymStorageOffset,  ///< `aten.sym_storage_offset`: a tensor's offset in its storage
    IntArithmetic,     ///< Python's `operator` module on symbolic ints (`arithmetic`)
  };

  Kind kind = Kind::Operator;              ///< what the step is
  std::string node;                        ///< the node's name, for messages
  std::string target;                      ///< what the node calls, as the graph names it, for messages
  std::optional<c10::OperatorHandle> op;   ///< the operator, for Kind::Operator
  OperatorArgumentCheck check = nullptr;   ///< what its kernel does not check itself (operator_checks.hpp), or null
  int size_argument = -1;                  ///< a factory's `size` (int list) argument, whose product it allocates; -1: none
  bool arange = false;                     ///< `arange`: allocates (end - start) / step elements

  OperatorOutputBytes output_bytes = nullptr;  ///< bounds its results' bytes before it runs (operator_output_bytes.hpp), or null

  /// @brief The bytes the step's results will hold at most, from its arguments, before it runs:
  /// its operator's rule, or for an operator without one (a user's addition) a factory's size at 8
  /// bytes an element; 0 when neither says. Saturates at INT64_MAX.
  int64_t bytes_to_allocate(const std::vector<c10::IValue>& stack) const {
    if (output_bytes != nullptr) return output_bytes(stack);
    const int64_t elements = elements_to_allocate(stack);
    return elements > std::numeric_limits<int64_t>::max() / 8 ? std::numeric_limits<int64_t>::max() : elements * 8;
  }

  /// @brief The elements a factory step (`size` argument, `arange`) is about to allocate, from its
  /// arguments; 0 for other steps. Saturates at INT64_MAX.
  int64_t elements_to_allocate(const std::vector<c10::IValue>& stack) const {
    constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
    if (size_argument >= 0 && static_cast<size_t>(size_argument) < stack.size() && stack[size_argument].isIntList()) {
      int64_t product = 1;
      for (const int64_t size : stack[size_argument].toIntVector()) {
        if (size < 0) return 0;  // the kernel refuses it
        if (size != 0 && product > kMax / size) return kMax;
        product *= size;
      }
      return product;
    }
    if (!arange) return 0;
    std::vector<double> numbers;  // [start,] end [, step]: the leading numeric arguments
    for (const auto& value : stack) {
      if (!value.isInt() && !value.isDouble()) break;
      numbers.push_back(value.isInt() ? static_cast<double>(value.toInt()) : value.toDouble());
    }
    if (numbers.empty()) return 0;
    const double start = numbers.size() >= 2 ? numbers[0] : 0.0, end = numbers.size() >= 2 ? numbers[1] : numbers[0];
    const double step = numbers.size() >= 3 ? numbers[2] : 1.0;
    if (step == 0.0) return 0;
    const double count = std::ceil((end - start) / step);
    return count <= 0.0 ? 0 : count >= 9.0e18 ? kMax : static_cast<int64_t>(count);
  }
  std::string arithmetic;                  ///< for IntArithmetic: "mul", "add", ...
  std::vector<ArgumentRecipe> arguments;   ///< how each argument is made when the step runs, in order
  std::vector<std::pair<size_t, c10::IValue>> eval_arguments;  ///< (argument index, value) replaced in eval mode
  bool skip_in_eval = false;               ///< the step does not run in eval mode
  std::vector<GraphOutputTarget> outputs;  ///< where each return goes
  std::vector<int> release;                ///< slots last used here, released after it

  /// @brief Runs the step.
  /// @param stack its arguments; its returns when it is done
  /// @param program the program, named in the context of an operator's error
  void call(std::vector<c10::IValue>& stack, const std::string& program) const {
    if (kind == Kind::Operator) {
      if (check != nullptr) {
        try {
          check(stack);
        } catch (const CheckpointError& error) {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", program, " node ", quote_untrusted(node), ": ", error.what()));
        }
      }
      try {
        op->callBoxed(stack);
      } catch (c10::Error& error) {
        error.add_context(trainloop::detail::concat("trainloop: while running node ", quote_untrusted(node), " (", quote_untrusted(target), ") of ", program));
        throw;
      }
      return;
    }
    if (kind == Kind::IntArithmetic) {
      stack = {symbolic_int_operation(arithmetic, stack)};
      return;
    }
    const auto& tensor = stack[0].toTensor();
    int64_t result = 0;
    if (kind == Kind::SymNumel) {
      result = tensor.numel();
    } else if (kind == Kind::SymStorageOffset) {
      result = tensor.storage_offset();
    } else {
      const int64_t dim = c10::maybe_wrap_dim(stack[1].toInt(), tensor.dim());
      result = kind == Kind::SymSize ? tensor.size(dim) : tensor.stride(dim);
    }
    stack = {c10::IValue(result)};
  }
};

/// @brief Whether a step after `after` uses `slot`, or `slot` is the program's output.
inline bool used_after(const std::vector<GraphStep>& steps, int slot, size_t after, int output_slot) {
  for (size_t s = after + 1; s < steps.size(); ++s) {
    for (const auto& argument : steps[s].arguments) {
      if (argument.slot == slot) return true;
      for (int used : argument.slots) {
        if (used == slot) return true;
      }
    }
  }
  return slot == output_slot;
}

/// @brief Fills each step's `release` with the slots it uses last, so that each value is released
/// after its last use (a value nothing uses, at once); never `output_slot`.
/// @param steps the program's steps, in order
/// @param slot_count how many slots the program's values take
/// @param output_slot the program's output
/// @param program the program, for messages
/// @throws trainloop::CheckpointError when a step skipped in eval mode makes a value used later.
inline void plan_releases(std::vector<GraphStep>& steps, size_t slot_count, int output_slot, const std::string& program) {
  std::vector<int> last(slot_count, -1);
  for (size_t s = 0; s < steps.size(); ++s) {
    for (const auto& argument : steps[s].arguments) {
      if (argument.slot >= 0) last[static_cast<size_t>(argument.slot)] = static_cast<int>(s);
      for (int slot : argument.slots) {
        if (slot >= 0) last[static_cast<size_t>(slot)] = static_cast<int>(s);
      }
    }
    for (const auto& output : steps[s].outputs) {
      for (int slot : output.slots) {
        if (last[static_cast<size_t>(slot)] < 0) last[static_cast<size_t>(slot)] = static_cast<int>(s);  // unused: free at once
        if (steps[s].skip_in_eval && used_after(steps, slot, s, output_slot)) {
          throw CheckpointError(trainloop::detail::concat("trainloop: ", program, " node ", quote_untrusted(steps[s].node),
                                                          " is skipped in eval mode but its result is used later"));
        }
      }
    }
  }
  for (size_t slot = 0; slot < slot_count; ++slot) {
    if (last[slot] >= 0 && static_cast<int>(slot) != output_slot) steps[static_cast<size_t>(last[slot])].release.push_back(static_cast<int>(slot));
  }
}

}  // namespace trainloop::serialization
