#pragma once
/// @file
/// @brief A program of a PT2 archive (`models/<name>.json`, the export schema of
/// torch/_export/serde/schema.yaml) read into what trainloop runs: the graph signature (which
/// placeholder is which parameter, buffer, constant or user input), the nodes in order, the user
/// input's sizes (symbolic ones by name, with their ranges) and the module path of each node
/// (its nn_module_stack). The node arguments stay JSON here; serialization::GraphProgram checks
/// them against the operator schemas.
///
/// The schema's major version must be the one this reader knows (8: torch 2.11 writes 8.17, 2.15 8.20);
/// minor versions only add fields, which are ignored. Everything is checked as it is read: a
/// field missing, of the wrong type, a name used twice, are errors naming the program and node.

#include <trainloop/error.hpp>
#include <trainloop/serialization/export/export_json.hpp>
#include <trainloop/serialization/export/pt2_archive.hpp>
#include <trainloop/serialization/quoted.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_set>
#include <utility>
#include <vector>

namespace trainloop::serialization {
TRAINLOOP_JSON_REFERENCES_BEGIN  // json_member's references: serialization/export/export_json.hpp

/// The export schema's major version this reader reads (torch 2.11 writes 8.17, 2.15 8.20).
inline constexpr int64_t kExportSchemaMajor = 8;

/// @brief One dimension of the user input as exported: a fixed size, or a symbol (torch.export.Dim).
struct ExportDim {
  std::optional<int64_t> fixed;  ///< the size, when it was exported fixed
  std::string symbol;            ///< the symbol ("s77"), when it is one; empty for an expression of several
  std::string expression;        ///< the expression as written (for messages)
  int64_t example = -1;          ///< the size of the example input, when the archive says it
};

/// @brief The range of a symbol (its range_constraints).
struct SymbolRange {
  int64_t min = 0;                ///< smallest allowed value
  std::optional<int64_t> max;     ///< largest allowed value; none when unbounded
};

/// @brief A graph placeholder and what it stands for (the signature's input_specs).
struct ExportInput {
  /// What fills the placeholder.
  enum class Kind { Parameter, Buffer, TensorConstant, UserInput };
  Kind kind = Kind::UserInput;  ///< what it is
  std::string graph_name;       ///< the placeholder's name in the graph ("p_conv1_weight")
  std::string target;           ///< the state_dict or constant name ("conv1.weight"); empty for a user input
  bool persistent = true;       ///< a buffer in the state_dict (false: a non-persistent buffer, in constants)
};

/// @brief One node: the operator it calls and its arguments (JSON, checked later).
struct ExportNode {
  std::string name;                      ///< the node's name ("conv2d_3")
  std::string target;                    ///< "torch.ops.aten.conv2d.default", "_operator.mul", ...
  const nlohmann::json* inputs = nullptr;   ///< list of {name, arg, kind}
  const nlohmann::json* outputs = nullptr;  ///< list of Argument
  std::string module_path;               ///< the innermost module that ran it ("layer1.0.bn1"); "" for the root
  std::string module_class;              ///< its class ("torch.nn.modules.batchnorm.BatchNorm2d")
};

/// @brief A program read from its JSON; see the file comment.
struct ExportGraph {
  std::string program;                     ///< "FILE's program NAME", for messages
  std::shared_ptr<const nlohmann::json> document;  ///< what the nodes' pointers point into
  int64_t schema_major = 0;                ///< its export schema's major version
  int64_t schema_minor = 0;                ///< and minor version
  std::string torch_version;               ///< the torch that wrote it, when it says
  std::vector<ExportInput> inputs;         ///< placeholders, in graph order
  std::string output;                      ///< the graph value the program returns (its one user output)
  std::vector<ExportNode> nodes;           ///< in execution order
  std::vector<ExportDim> input_dims;       ///< the user input's dimensions
  std::map<std::string, SymbolRange> ranges;  ///< symbol -> allowed values
  std::map<std::string, std::string> module_classes;  ///< module path -> class, from the nodes' nn_module_stack
  std::map<std::string, std::vector<int64_t>> state_sizes;  ///< placeholder -> the sizes the graph was traced with
};

namespace detail {

/// The symbol of a sympy expression as export writes it: "Symbol('s77', positive=True, integer=True)"
/// or "s77"; empty for an expression of several symbols or operators.
inline std::string export_symbol_of(const std::string& expression) {
  auto is_name = [](const std::string& text) {
    if (text.empty() || !(std::isalpha(static_cast<unsigned char>(text[0])) || text[0] == '_')) return false;
    for (char c : text) {
      if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_')) return false;
    }
    return true;
  };
  if (is_name(expression)) return expression;
  const std::string head = "Symbol('";
  if (expression.compare(0, head.size(), head) == 0) {
    const auto end = expression.find('\'', head.size());
    if (end != std::string::npos && expression.find("Symbol(", end) == std::string::npos && expression.back() == ')') {
      const std::string name = expression.substr(head.size(), end - head.size());
      if (is_name(name)) return name;
    }
  }
  return {};
}

/// The (path, class) pairs of a node's nn_module_stack ("key,path,class;key,path,class"), outermost first.
inline std::vector<std::pair<std::string, std::string>> module_stack(const std::string& stack) {
  std::vector<std::pair<std::string, std::string>> modules;
  size_t start = 0;
  while (start <= stack.size()) {
    const auto end = std::min(stack.find(';', start), stack.size());
    const std::string entry = stack.substr(start, end - start);
    const auto first_comma = entry.find(','), last_comma = entry.rfind(',');
    if (first_comma != std::string::npos && first_comma != last_comma) {
      modules.emplace_back(entry.substr(first_comma + 1, last_comma - first_comma - 1), entry.substr(last_comma + 1));
    }
    start = end + 1;
  }
  return modules;
}

}  // namespace detail

/// @brief Reads program `name` of `archive` (its `models/NAME.json`).
/// @throws trainloop::CheckpointError naming the program for another schema major version, a
///         missing or mistyped field, a signature trainloop cannot train (not exactly one tensor
///         in and one tensor out, custom objects, tokens, mutated inputs).
inline ExportGraph read_export_graph(const Pt2Archive& archive, const std::string& name) {
  using trainloop::detail::concat;
  ExportGraph graph;
  graph.program = concat(archive.path().string(), "'s program ", quote_untrusted(name));
  const std::string& where = graph.program;
  auto fail = [&](const std::string& what) { return CheckpointError(concat("trainloop: ", where, " ", what)); };
  graph.document = std::make_shared<const nlohmann::json>(archive.read_json("models/" + name + ".json"));
  const auto& root = *graph.document;

  const auto& version = json_member(root, "schema_version", where);
  graph.schema_major = json_int(json_member(version, "major", where + " schema_version"), where + " schema_version.major");
  graph.schema_minor = json_int(json_member(version, "minor", where + " schema_version"), where + " schema_version.minor");
  if (root.contains("torch_version") && root["torch_version"].is_string()) {
    graph.torch_version = root["torch_version"].get<std::string>();
  }
  if (graph.schema_major != kExportSchemaMajor) {
    throw fail(concat("was written with export schema ", graph.schema_major, ".", graph.schema_minor, " (torch ",
                      graph.torch_version.empty() ? "unknown" : quote_untrusted(graph.torch_version),
                      "); expected schema ", kExportSchemaMajor, ".x, which torch 2.11 to 2.15 write (8.17 to 8.20): export it "
                      "again with one of them, or with a torch whose torch/_export/serde/schema.yaml says SCHEMA_VERSION ",
                      kExportSchemaMajor));
  }
  const auto& module = json_member(root, "graph_module", where);
  const auto& body = json_member(module, "graph", where + " graph_module");
  const auto& signature = json_member(module, "signature", where + " graph_module");

  // The signature: placeholders in order, and what the program returns.
  const auto& input_specs = json_member(signature, "input_specs", where + " signature");
  if (!input_specs.is_array()) throw fail("signature.input_specs is not a list");
  size_t user_inputs = 0;
  for (const auto& spec : input_specs) {
    auto [kind, value] = json_union(spec, where + " input spec");
    ExportInput input;
    auto arg_name = [&, value = value](const char* key) {
      return json_string(json_member(json_member(*value, "arg", where + " input spec"), key, where + " input spec"),
                         where + " input spec name");
    };
    if (kind == "parameter") {
      input.kind = ExportInput::Kind::Parameter;
      input.graph_name = arg_name("name");
      input.target = json_string(json_member(*value, "parameter_name", where), where + " parameter_name");
    } else if (kind == "buffer") {
      input.kind = ExportInput::Kind::Buffer;
      input.graph_name = arg_name("name");
      input.target = json_string(json_member(*value, "buffer_name", where), where + " buffer_name");
      if (value->contains("persistent") && (*value)["persistent"].is_boolean()) input.persistent = (*value)["persistent"].get<bool>();
    } else if (kind == "tensor_constant") {
      input.kind = ExportInput::Kind::TensorConstant;
      input.graph_name = arg_name("name");
      input.target = json_string(json_member(*value, "tensor_constant_name", where), where + " tensor_constant_name");
    } else if (kind == "user_input") {
      auto [arg_kind, arg] = json_union(json_member(*value, "arg", where + " user input"), where + " user input");
      if (arg_kind != "as_tensor") {
        throw fail(concat("takes a user input that is ", quote_untrusted(arg_kind), "; expected exactly one tensor input (forward(x))"));
      }
      input.kind = ExportInput::Kind::UserInput;
      input.graph_name = json_string(json_member(*arg, "name", where), where + " user input name");
      ++user_inputs;
    } else {
      throw fail(concat("has an input of kind ", quote_untrusted(kind), "; expected parameters, buffers, tensor ",
                        "constants and one tensor input (custom objects, tokens and constant inputs are not supported)"));
    }
    graph.inputs.push_back(std::move(input));
  }
  // The names the tensors are registered under in the module tree: dotted paths of non-empty
  // parts, each once.
  std::unordered_set<std::string> targets;
  for (const auto& input : graph.inputs) {
    if (input.kind == ExportInput::Kind::UserInput) continue;
    const std::string& name = input.target;
    const bool empty_part = name.empty() || name.front() == '.' || name.back() == '.' || name.find("..") != std::string::npos;
    if (empty_part) {
      throw fail(concat("names a tensor ", quote_untrusted(name), "; expected a dotted path of non-empty names (\"layer1.0.weight\")"));
    }
    // The names become attribute names of the modules trainloop registers, which libtorch's
    // checkpoints write into TorchScript code: a quote, a newline or a bracket there made a
    // checkpoint that no resume could read (issue 50). Real models' names are identifiers and
    // indices (torchvision, timm, the zoo); `-` is allowed for ModuleDict keys.
    const auto bad = std::find_if(name.begin(), name.end(), [](char c) {
      return !(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.');
    });
    if (bad != name.end()) {
      throw fail(concat("names a tensor ", quote_untrusted(name), ", whose character ", quote_untrusted(std::string(1, *bad)),
                        " is not a letter, digit, '_' or '-'; expected module and parameter names as Python's ",
                        "identifiers and ModuleDict keys spell them (\"layer1.0.weight\")"));
    }
    if (!targets.insert(name).second) throw fail(concat("names the tensor ", quote_untrusted(name), " twice; expected each once"));
  }
  if (user_inputs != 1) {
    throw fail(concat("takes ", user_inputs, " tensor inputs; expected exactly one (forward(x)), the loop's contract: "
                      "wrap the model in Python in a module whose forward takes one tensor before exporting it"));
  }
  const auto& output_specs = json_member(signature, "output_specs", where + " signature");
  if (!output_specs.is_array()) throw fail("signature.output_specs is not a list");
  for (const auto& spec : output_specs) {
    auto [kind, value] = json_union(spec, where + " output spec");
    if (kind != "user_output") {
      throw fail(concat("has an output of kind ", quote_untrusted(kind), "; expected only user outputs: export with ",
                        "torch.export.export (its training IR mutates buffers in place) and without "
                        "run_decompositions(), whose functional graph returns buffer mutations"));
    }
    auto [arg_kind, arg] = json_union(json_member(*value, "arg", where + " output"), where + " output");
    if (arg_kind != "as_tensor" || !graph.output.empty()) {
      throw fail("returns something other than one tensor; expected forward(x) -> Tensor (wrap the model in Python "
                 "so that forward returns one tensor, e.g. the logits)");
    }
    graph.output = json_string(json_member(*arg, "name", where), where + " output name");
  }
  if (graph.output.empty()) throw fail("returns nothing; expected forward(x) -> Tensor");

  // The user input's sizes and the symbols' ranges; the sizes the other placeholders were traced with.
  const auto& tensor_values = json_member(body, "tensor_values", where + " graph");
  for (const auto& input : graph.inputs) {
    if (input.kind != ExportInput::Kind::UserInput) {
      const auto found = tensor_values.find(input.graph_name);
      if (found == tensor_values.end() || !found->is_object() || !found->contains("sizes") || !(*found)["sizes"].is_array()) continue;
      std::vector<int64_t> sizes;
      for (const auto& size : (*found)["sizes"]) {
        if (size.is_object() && size.contains("as_int") && size["as_int"].is_number_integer()) sizes.push_back(size["as_int"].get<int64_t>());
      }
      if (sizes.size() == (*found)["sizes"].size()) graph.state_sizes[input.graph_name] = std::move(sizes);
      continue;
    }
    const auto& meta = json_member(tensor_values, input.graph_name.c_str(), where + " tensor_values");
    const auto& sizes = json_member(meta, "sizes", where + " input " + quote_untrusted(input.graph_name));
    if (!sizes.is_array() || sizes.size() > 64) throw fail("has an input whose sizes are not a list of at most 64");
    for (const auto& size : sizes) {
      auto [kind, value] = json_union(size, where + " input size");
      ExportDim dim;
      if (kind == "as_int") {
        dim.fixed = json_int(*value, where + " input size");
        dim.example = *dim.fixed;
      } else if (kind == "as_expr") {
        dim.expression = json_string(json_member(*value, "expr_str", where + " input size"), where + " expr_str");
        dim.symbol = detail::export_symbol_of(dim.expression);
        if (value->contains("hint") && (*value)["hint"].is_object() && (*value)["hint"].contains("as_int") &&
            (*value)["hint"]["as_int"].is_number_integer()) {
          dim.example = (*value)["hint"]["as_int"].get<int64_t>();
        }
      } else {
        throw fail(concat("has an input size of kind ", quote_untrusted(kind), "; expected as_int or as_expr"));
      }
      graph.input_dims.push_back(std::move(dim));
    }
  }
  if (root.contains("range_constraints") && root["range_constraints"].is_object()) {
    for (const auto& [symbol, range] : root["range_constraints"].items()) {
      SymbolRange bounds;
      if (range.is_object() && range.contains("min_val") && range["min_val"].is_number_integer()) {
        bounds.min = range["min_val"].get<int64_t>();
      }
      if (range.is_object() && range.contains("max_val") && range["max_val"].is_number_integer()) {
        bounds.max = range["max_val"].get<int64_t>();
      }
      graph.ranges[symbol] = bounds;
    }
  }

  // The nodes.
  const auto& nodes = json_member(body, "nodes", where + " graph");
  if (!nodes.is_array()) throw fail("graph.nodes is not a list");
  std::unordered_set<std::string> names;
  for (const auto& item : nodes) {
    ExportNode node;
    node.target = json_string(json_member(item, "target", where + " node"), where + " node target");
    node.inputs = &json_member(item, "inputs", where + " node " + quote_untrusted(node.target));
    node.outputs = &json_member(item, "outputs", where + " node " + quote_untrusted(node.target));
    if (!node.inputs->is_array() || !node.outputs->is_array()) {
      throw fail(concat("has the node ", quote_untrusted(node.target), " whose inputs or outputs are not lists"));
    }
    if (item.contains("name") && item["name"].is_string()) node.name = item["name"].get<std::string>();
    if (node.name.empty()) node.name = concat("#", graph.nodes.size());
    if (!names.insert(node.name).second) throw fail(concat("has two nodes named ", quote_untrusted(node.name)));
    if (item.contains("metadata") && item["metadata"].is_object() && item["metadata"].contains("nn_module_stack") &&
        item["metadata"]["nn_module_stack"].is_string()) {
      for (const auto& [path, qualified] : detail::module_stack(item["metadata"]["nn_module_stack"].get<std::string>())) {
        std::tie(node.module_path, node.module_class) = std::make_pair(path, qualified);
        if (!path.empty()) graph.module_classes.emplace(path, qualified);
      }
    }
    graph.nodes.push_back(std::move(node));
  }
  return graph;
}

TRAINLOOP_JSON_REFERENCES_END
}  // namespace trainloop::serialization
