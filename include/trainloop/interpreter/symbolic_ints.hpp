#pragma once
/// @file
/// @brief The nodes of an exported graph that compute symbolic sizes rather than tensors: Python's
/// `operator` functions on ints (`_operator.mul` of a batch size by 2, comparisons for asserts),
/// evaluated here as Python would on 64 bits — floor division and modulo rounding toward negative
/// infinity — with what would overflow an error (c10::Error naming the operation), never
/// undefined behaviour; and the arguments of such nodes.

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_arguments.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <limits>
#include <set>
#include <string>
#include <vector>

namespace trainloop::serialization {

/// @brief True for the `operator` functions symbolic_int_operation() evaluates.
inline bool is_symbolic_int_operation(const std::string& name) {
  static const std::set<std::string> known = {"add", "sub", "mul", "floordiv", "mod", "neg",
                                              "eq",  "ne",  "lt",  "le",       "gt",  "ge", "and_", "or_"};
  return known.count(name) != 0;
}

/// @brief Python's `operator.<operation>` on ints (or bools, as 0 and 1).
/// @throws c10::Error for a division by zero or a result outside 64 bits.
inline c10::IValue symbolic_int_operation(const std::string& operation, const std::vector<c10::IValue>& arguments) {

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

/// @brief An argument of a node computed here (a symbolic-int operation, `aten.sym_size`): a
/// graph value (tensor or symbolic int, by name) or a constant int or bool.
/// @throws trainloop::CheckpointError naming the node for any other kind.
inline ArgumentRecipe plain_argument_recipe(const nlohmann::json& input, const std::string& where, const SlotLookup& slot_of) {
  const auto unioned = json_union(json_member(input, "arg", where), where + " argument");
  const std::string& kind = unioned.first;
  const nlohmann::json& value = *unioned.second;
  ArgumentRecipe recipe;
  if (kind == "as_int") {
    recipe.constant = json_int(value, where);
  } else if (kind == "as_bool" && value.is_boolean()) {
    recipe.constant = value.get<bool>();
  } else if (kind == "as_tensor") {
    recipe.kind = ArgumentRecipe::Kind::Value;
    recipe.slot = slot_of(json_string(json_member(value, "name", where), where));
  } else if (kind == "as_sym_int" || kind == "as_sym_bool") {
    const auto symbolic = json_union(value, where);
    if (symbolic.first == "as_name") {
      recipe.kind = ArgumentRecipe::Kind::SymbolicValue;
      recipe.slot = slot_of(json_string(*symbolic.second, where));
    } else if (symbolic.first == "as_bool" && symbolic.second->is_boolean()) {
      recipe.constant = symbolic.second->get<bool>();
    } else if (symbolic.first == "as_int") {
      recipe.constant = json_int(*symbolic.second, where);
    } else {
      throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has a symbolic argument of kind ",
                                                      quote_untrusted(symbolic.first), "; expected as_name, as_int or as_bool"));
    }
  } else {
    throw CheckpointError(trainloop::detail::concat("trainloop: ", where, " has an argument of kind ", quote_untrusted(kind),
                                                    "; expected tensors and symbolic ints"));
  }
  return recipe;
}

}  // namespace trainloop::serialization
