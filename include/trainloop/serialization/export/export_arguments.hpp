#pragma once
/// @file
/// @brief The arguments of an exported node, turned at load into recipes that build the boxed
/// call's stack at run time: constants made once, graph values (tensors, symbolic ints) read
/// from their slots. Each argument is checked against the type the operator's schema declares
/// for it, so a node whose arguments do not match its operator is refused at load, not at step
/// 1000 (nor handed to a kernel that would read it as something else).

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/export/pt2_archive.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <ATen/core/function_schema.h>
#include <ATen/core/ivalue.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace trainloop::serialization {
TRAINLOOP_JSON_REFERENCES_BEGIN  // json_member's references: serialization/export/export_json.hpp

/// @brief How one argument of a call is made at run time.
struct ArgumentRecipe {
  /// What the argument is.
  enum class Kind {
    Constant,        ///< `constant`, made at load
    Value,           ///< the graph tensor in `slot`
    SymbolicValue,   ///< the graph's symbolic int or bool in `slot`
    TensorList,      ///< tensors in `slots`
    OptionalTensors, ///< tensors or None (slot -1) in `slots`
    IntList,         ///< ints: `ints[i]`, or the symbolic int in `slots[i]` when that is >= 0
    Device,          ///< a device the program names: the device the input is on when run
    WrappedNumber,   ///< the symbolic int or bool in `slot`, as a 0-dim "wrapped number" tensor
  };
  Kind kind = Kind::Constant;  ///< what it is
  c10::IValue constant;        ///< for Constant
  int slot = -1;               ///< for Value
  std::vector<int> slots;      ///< for the lists
  std::vector<int64_t> ints;   ///< for IntList
};

/// @brief Names the slot of a graph value, or throws when no earlier node made it.
using SlotLookup = std::function<int(const std::string& value_name)>;

namespace detail {

/// The schema type without an Optional around it.
inline c10::TypePtr without_optional(const c10::TypePtr& type) {
  if (auto optional = type->cast<c10::OptionalType>()) return optional->getElementType();
  return type;
}

inline bool is_int_like(const c10::TypePtr& type) {
  return type->kind() == c10::TypeKind::IntType || type->str() == "SymInt";
}

/// The element type of a list type, or nullptr.
inline c10::TypePtr list_element(const c10::TypePtr& type) {
  if (auto list = type->cast<c10::ListType>()) return list->getElementType();
  return nullptr;
}

}  // namespace detail

/// @brief The recipe of argument `argument` (a schema Argument union) for the schema argument
/// `expected` of node `where`.
/// @throws trainloop::CheckpointError naming the node, the argument, what it is and what the
///         schema expects, when they do not match or the kind is one trainloop does not run.
inline ArgumentRecipe make_argument_recipe(const nlohmann::json& argument, const c10::Argument& expected,
                                           const std::string& where, const SlotLookup& slot_of) {
  using trainloop::detail::concat;
  const std::string what = where + " argument '" + expected.name() + "'";
  // Not a structured binding: the lambdas below capture them (C++17, which the fuzz target builds in).
  const auto unioned = json_union(argument, what);
  const std::string& kind = unioned.first;
  const nlohmann::json* value = unioned.second;
  const c10::TypePtr declared = expected.type();
  const c10::TypePtr type = detail::without_optional(declared);
  const c10::TypePtr element = detail::list_element(type);
  const bool optional = declared->kind() == c10::TypeKind::OptionalType;
  auto mismatch = [&]() {
    return CheckpointError(concat("trainloop: ", what, " is ", kind, " ", escape_untrusted(value->dump().substr(0, 60)),
                                  "; expected ", declared->str(), " (the operator's schema): the node does not match ",
                                  "the operator of this libtorch"));
  };
  auto name_of = [&](const nlohmann::json& tensor_argument) {
    return json_string(json_member(tensor_argument, "name", what), what + " name");
  };
  auto sym_int = [&](const nlohmann::json& item, ArgumentRecipe& recipe) {
    auto [sym_kind, sym_value] = json_union(item, what);
    if (sym_kind == "as_int") {
      recipe.ints.push_back(json_int(*sym_value, what));
      recipe.slots.push_back(-1);
    } else if (sym_kind == "as_name") {
      recipe.ints.push_back(0);
      recipe.slots.push_back(slot_of(json_string(*sym_value, what)));
    } else {
      throw mismatch();
    }
  };
  ArgumentRecipe recipe;
  using Kind = ArgumentRecipe::Kind;
  const auto type_kind = type->kind();
  // A Python number where the schema takes a Tensor (`x.add_(1)` on a Tensor overload): what
  // Python's binding makes of it, a 0-dim "wrapped number" that type promotion treats as a scalar.
  // A symbolic one too: `y * x.shape[0]` exports mul.Tensor(y, <SymInt>), made when the program runs.
  if (type_kind == c10::TypeKind::TensorType && (kind == "as_int" || kind == "as_float" || kind == "as_bool" ||
                                                 kind == "as_sym_int" || kind == "as_sym_bool")) {
    const auto symbolic = kind == "as_sym_int" || kind == "as_sym_bool" ? json_union(*value, what) : unioned;
    const std::string& number_kind = symbolic.first;
    const nlohmann::json& number_value = *symbolic.second;
    if (kind != number_kind && number_kind == "as_name") {
      recipe.kind = Kind::WrappedNumber;
      recipe.slot = slot_of(json_string(number_value, what));
      return recipe;
    }
    torch::Tensor number;
    if (number_kind == "as_int" && kind != "as_sym_bool") {
      number = torch::scalar_tensor(json_int(number_value, what), torch::kLong);
    } else if (number_kind == "as_float" && kind == "as_float" && number_value.is_number()) {
      number = torch::scalar_tensor(number_value.get<double>(), torch::kDouble);
    } else if (number_kind == "as_bool" && kind != "as_sym_int" && number_value.is_boolean()) {
      number = torch::scalar_tensor(number_value.get<bool>(), torch::kBool);
    } else {
      throw mismatch();
    }
    number.unsafeGetTensorImpl()->set_wrapped_number(true);
    recipe.constant = number;
    return recipe;
  }
  if (kind == "as_none") {
    if (!optional && type_kind != c10::TypeKind::NoneType) throw mismatch();
    recipe.constant = c10::IValue();
  } else if (kind == "as_tensor") {
    if (type_kind != c10::TypeKind::TensorType) throw mismatch();
    recipe.kind = Kind::Value;
    recipe.slot = slot_of(name_of(*value));
  } else if (kind == "as_tensors" || kind == "as_optional_tensors") {
    if (!value->is_array() || !element) throw mismatch();
    const bool optional_elements = element->kind() == c10::TypeKind::OptionalType;
    if (detail::without_optional(element)->kind() != c10::TypeKind::TensorType) throw mismatch();
    recipe.kind = optional_elements ? Kind::OptionalTensors : Kind::TensorList;
    for (const auto& item : *value) {
      if (kind == "as_tensors") {
        recipe.slots.push_back(slot_of(name_of(item)));
        continue;
      }
      auto [item_kind, item_value] = json_union(item, what);
      if (item_kind == "as_none" && optional_elements) {
        recipe.slots.push_back(-1);
      } else if (item_kind == "as_tensor") {
        recipe.slots.push_back(slot_of(name_of(*item_value)));
      } else {
        throw mismatch();
      }
    }
  } else if (kind == "as_int") {
    const int64_t number = json_int(*value, what);
    if (detail::is_int_like(type) || type_kind == c10::TypeKind::NumberType) {
      recipe.constant = number;
    } else if (element && detail::is_int_like(element) && expected.N()) {  // int[2] stride=1
      recipe.constant = c10::List<int64_t>(std::vector<int64_t>(static_cast<size_t>(*expected.N()), number));
    } else if (type_kind == c10::TypeKind::FloatType) {
      recipe.constant = static_cast<double>(number);
    } else {
      throw mismatch();
    }
  } else if (kind == "as_ints" || kind == "as_sym_ints") {
    if (!value->is_array() || !element || !detail::is_int_like(element)) throw mismatch();
    recipe.kind = Kind::IntList;
    for (const auto& item : *value) {
      if (kind == "as_ints") {
        recipe.ints.push_back(json_int(item, what));
        recipe.slots.push_back(-1);
      } else {
        sym_int(item, recipe);
      }
    }
  } else if (kind == "as_sym_int" || kind == "as_sym_bool") {
    const bool wants_bool = kind == "as_sym_bool";
    if (!(wants_bool ? type_kind == c10::TypeKind::BoolType : detail::is_int_like(type)) &&
        type_kind != c10::TypeKind::NumberType) {
      throw mismatch();
    }
    auto [sym_kind, sym_value] = json_union(*value, what);
    if (sym_kind == "as_name") {
      recipe.kind = Kind::SymbolicValue;
      recipe.slot = slot_of(json_string(*sym_value, what));
    } else if (sym_kind == "as_int" && !wants_bool) {
      recipe.constant = json_int(*sym_value, what);
    } else if (sym_kind == "as_bool" && wants_bool && sym_value->is_boolean()) {
      recipe.constant = sym_value->get<bool>();
    } else {
      throw mismatch();
    }
  } else if (kind == "as_float") {
    if (!value->is_number() || (type_kind != c10::TypeKind::FloatType && type_kind != c10::TypeKind::NumberType)) throw mismatch();
    recipe.constant = value->get<double>();
  } else if (kind == "as_floats" || kind == "as_bools") {
    // A list of floats (float[]) or flags (bool[]); each item of the JSON kind the list says.
    const bool floats = kind == "as_floats";
    const auto wanted = floats ? c10::TypeKind::FloatType : c10::TypeKind::BoolType;
    if (!value->is_array() || !element || element->kind() != wanted) throw mismatch();
    c10::List<double> numbers;
    c10::List<bool> flags;
    for (const auto& item : *value) {
      if (floats ? !item.is_number() : !item.is_boolean()) throw mismatch();
      if (floats) {
        numbers.push_back(item.get<double>());
      } else {
        flags.push_back(item.get<bool>());
      }
    }
    recipe.constant = floats ? c10::IValue(numbers) : c10::IValue(flags);
  } else if (kind == "as_bool") {
    if (!value->is_boolean() || (type_kind != c10::TypeKind::BoolType && type_kind != c10::TypeKind::NumberType)) throw mismatch();
    recipe.constant = value->get<bool>();
  } else if (kind == "as_string") {
    if (type_kind != c10::TypeKind::StringType) throw mismatch();
    recipe.constant = json_string(*value, what);
  } else if (kind == "as_scalar_type") {
    if (!detail::is_int_like(type)) throw mismatch();  // schemas declare ScalarType as int
    recipe.constant = export_scalar_type(json_int(*value, what), what);
  } else if (kind == "as_memory_format") {
    if (!detail::is_int_like(type)) throw mismatch();
    const int64_t code = json_int(*value, what);
    static const c10::MemoryFormat formats[] = {c10::MemoryFormat::Contiguous, c10::MemoryFormat::Contiguous,
                                                c10::MemoryFormat::ChannelsLast, c10::MemoryFormat::ChannelsLast3d,
                                                c10::MemoryFormat::Preserve};
    if (code < 1 || code > 4) throw mismatch();
    recipe.constant = formats[code];
  } else if (kind == "as_layout") {
    if (!detail::is_int_like(type) || json_int(*value, what) != 7) {
      throw CheckpointError(concat("trainloop: ", what, " is layout ", escape_untrusted(value->dump()),
                                   "; expected 7 (strided): sparse layouts are not run"));
    }
    recipe.constant = c10::kStrided;
  } else if (kind == "as_device") {
    if (type_kind != c10::TypeKind::DeviceObjType) throw mismatch();
    const std::string& device = json_string(json_member(*value, "type", what), what + " type");
    if (device != "cpu" && device != "cuda") {
      throw CheckpointError(concat("trainloop: ", what, " is the device ", quote_untrusted(device),
                                   "; expected cpu or cuda (the node then runs on the input's device)"));
    }
    recipe.kind = Kind::Device;
  } else {
    throw CheckpointError(concat("trainloop: ", what, " is ", quote_untrusted(kind), ", which trainloop does not run ",
                                 "(subgraphs, custom objects, operators as values, symbolic floats); expected tensors, ",
                                 "numbers, lists, dtypes and devices"));
  }
  return recipe;
}

namespace detail {

/// The graph value in `slot`, which the program uses as a tensor (`tensor`) or an int; a value of
/// the other kind (a crafted graph that computes a tensor where it uses an int) is a
/// CheckpointError, not libtorch's internal assertion in IValue::toInt.
inline const c10::IValue& graph_value(const std::vector<c10::IValue>& values, int slot, bool tensor) {
  const c10::IValue& value = values[static_cast<size_t>(slot)];
  if (tensor ? !value.isTensor() : !(value.isInt() || value.isBool())) {
    throw CheckpointError(trainloop::detail::concat("a value used as ", tensor ? "a tensor" : "an int", " is ",
                                                    value.tagKind(), "; expected ", tensor ? "a tensor" : "an int",
                                                    " (the graph computes one kind of value and uses another)"));
  }
  return value;
}

}  // namespace detail

/// @brief The argument's value for a call, from the recipe and the graph values.
/// @throws trainloop::CheckpointError when a graph value is not of the kind the argument takes.
inline c10::IValue make_argument(const ArgumentRecipe& recipe, const std::vector<c10::IValue>& values,
                                 const c10::Device& device) {
  using Kind = ArgumentRecipe::Kind;
  switch (recipe.kind) {
    case Kind::Constant: return recipe.constant;
    case Kind::Value: return detail::graph_value(values, recipe.slot, true);
    case Kind::SymbolicValue: return detail::graph_value(values, recipe.slot, false);
    case Kind::TensorList: {
      c10::List<at::Tensor> list;
      list.reserve(recipe.slots.size());
      for (int slot : recipe.slots) list.push_back(detail::graph_value(values, slot, true).toTensor());
      return list;
    }
    case Kind::OptionalTensors: {
      c10::List<c10::optional<at::Tensor>> list;
      list.reserve(recipe.slots.size());
      for (int slot : recipe.slots) {
        list.push_back(slot < 0 ? c10::optional<at::Tensor>()
                                : c10::optional<at::Tensor>(detail::graph_value(values, slot, true).toTensor()));
      }
      return list;
    }
    case Kind::IntList: {
      c10::List<int64_t> list;
      list.reserve(recipe.ints.size());
      for (size_t i = 0; i < recipe.ints.size(); ++i) {
        list.push_back(recipe.slots[i] < 0 ? recipe.ints[i] : detail::graph_value(values, recipe.slots[i], false).toInt());
      }
      return list;
    }
    case Kind::Device: return device;
    case Kind::WrappedNumber: {
      const c10::IValue& number = detail::graph_value(values, recipe.slot, false);
      torch::Tensor wrapped = number.isBool() ? torch::scalar_tensor(number.toBool(), torch::kBool)
                                              : torch::scalar_tensor(number.toInt(), torch::kLong);
      wrapped.unsafeGetTensorImpl()->set_wrapped_number(true);
      return wrapped;
    }
  }
  return {};
}

TRAINLOOP_JSON_REFERENCES_END
}  // namespace trainloop::serialization
