#pragma once
// PT2 archives made in C++, for the cases that need no Python (they run on libtorch 1.13 too) and
// for the bad-input cases: the layout torch.export.save writes (models/model.json in the export
// schema, data/weights/model_weights_config.json, raw weight files), written with libtorch's own
// zip writer, and a small program in that schema that a test can break one field at a time.
//
// The program (what torch.export makes of this Python module in train mode):
//
//   class Tiny(nn.Module):       # fc1: Linear(4, 3), bn: BatchNorm1d(3), fc2: Linear(3, 2)
//       def forward(self, x):    # x: [batch, 4], batch a torch.export.Dim in [1, 64]
//           return self.fc2(torch.relu(self.bn(self.fc1(x))))

#include <trainloop/error.hpp>

#include <caffe2/serialize/inline_container.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace pt2_fixture {

using nlohmann::json;

/// The tiny program's tensors, by state_dict name, in the order of its placeholders.
inline std::vector<std::pair<std::string, torch::Tensor>> tiny_weights() {
  torch::manual_seed(11);
  return {{"fc1.weight", torch::randn({3, 4}) * 0.5},
          {"fc1.bias", torch::randn({3}) * 0.1},
          {"bn.weight", torch::rand({3}) + 0.5},
          {"bn.bias", torch::randn({3}) * 0.1},
          {"fc2.weight", torch::randn({2, 3}) * 0.5},
          {"fc2.bias", torch::randn({2}) * 0.1},
          {"bn.running_mean", torch::randn({3}) * 0.1},
          {"bn.running_var", torch::rand({3}) + 0.5},
          {"bn.num_batches_tracked", torch::tensor(int64_t{0})}};
}

inline json tensor_arg(const std::string& name) { return {{"as_tensor", {{"name", name}}}}; }
inline json named(const std::string& name, json arg) { return {{"name", name}, {"arg", std::move(arg)}, {"kind", 1}}; }

inline json node(const std::string& name, const std::string& target, json inputs, const std::string& output,
                 const std::string& module = "") {
  json item = {{"name", name}, {"target", target}, {"inputs", std::move(inputs)},
               {"outputs", json::array({tensor_arg(output)})}, {"metadata", json::object()}};
  if (!module.empty()) {
    const std::string kind = module == "bn" ? "torch.nn.modules.batchnorm.BatchNorm1d" : "torch.nn.modules.linear.Linear";
    item["metadata"]["nn_module_stack"] = "L__self__,,__main__.Tiny;L__self__" + module + "," + module + "," + kind;
  }
  return item;
}

inline json sizes_of(const std::vector<int64_t>& sizes) {
  json list = json::array();
  for (auto size : sizes) list.push_back({{"as_int", size}});
  return list;
}

/// TensorMeta of a contiguous tensor of `sizes` (dtype 7: float32; 5: int64); parameters require grad.
inline json tensor_meta(const std::vector<int64_t>& sizes, int dtype = 7, bool parameter = true) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (size_t d = sizes.size(); d-- > 1;) strides[d - 1] = strides[d] * sizes[d];
  return {{"dtype", dtype}, {"sizes", sizes_of(sizes)}, {"strides", sizes_of(strides)}, {"requires_grad", dtype == 7 && parameter},
          {"device", {{"type", "cpu"}, {"index", nullptr}}}, {"storage_offset", {{"as_int", 0}}}, {"layout", 7}};
}

/// The program's JSON (models/model.json). `fixed_batch`: the batch exported as a fixed 4.
inline json tiny_program(bool fixed_batch = false) {
  json inputs = json::array();
  json tensor_values = json::object();
  for (const auto& [name, tensor] : tiny_weights()) {
    std::string graph_name = name;
    for (auto& c : graph_name) c = c == '.' ? '_' : c;
    const bool buffer = name.rfind("bn.running", 0) == 0 || name == "bn.num_batches_tracked";
    graph_name = (buffer ? "b_" : "p_") + graph_name;
    if (buffer) {
      inputs.push_back({{"buffer", {{"arg", {{"name", graph_name}}}, {"buffer_name", name}, {"persistent", true}}}});
    } else {
      inputs.push_back({{"parameter", {{"arg", {{"name", graph_name}}}, {"parameter_name", name}}}});
    }
    tensor_values[graph_name] = tensor_meta(tensor.sizes().vec(), tensor.scalar_type() == torch::kLong ? 5 : 7, !buffer);
  }
  inputs.push_back({{"user_input", {{"arg", tensor_arg("x")}}}});
  json x_meta = tensor_meta({4, 4});
  if (!fixed_batch) {
    x_meta["sizes"][0] = {{"as_expr", {{"expr_str", "Symbol('s0', positive=True, integer=True)"}, {"hint", {{"as_int", 4}}}}}};
  }
  tensor_values["x"] = x_meta;
  json nodes = json::array({
      node("linear", "torch.ops.aten.linear.default",
           {named("input", tensor_arg("x")), named("weight", tensor_arg("p_fc1_weight")), named("bias", tensor_arg("p_fc1_bias"))},
           "linear", "fc1"),
      node("add_", "torch.ops.aten.add_.Tensor",
           {named("self", tensor_arg("b_bn_num_batches_tracked")), named("other", {{"as_int", 1}})}, "add_", "bn"),
      node("batch_norm", "torch.ops.aten.batch_norm.default",
           {named("input", tensor_arg("linear")), named("weight", tensor_arg("p_bn_weight")),
            named("bias", tensor_arg("p_bn_bias")), named("running_mean", tensor_arg("b_bn_running_mean")),
            named("running_var", tensor_arg("b_bn_running_var")), named("training", {{"as_bool", true}}),
            named("momentum", {{"as_float", 0.1}}), named("eps", {{"as_float", 1e-5}}),
            named("cudnn_enabled", {{"as_bool", false}})},
           "batch_norm", "bn"),
      node("relu", "torch.ops.aten.relu.default", {named("self", tensor_arg("batch_norm"))}, "relu"),
      node("linear_1", "torch.ops.aten.linear.default",
           {named("input", tensor_arg("relu")), named("weight", tensor_arg("p_fc2_weight")),
            named("bias", tensor_arg("p_fc2_bias"))},
           "linear_1", "fc2"),
  });
  json range_constraints = json::object();
  if (!fixed_batch) range_constraints["s0"] = {{"min_val", 1}, {"max_val", 64}};
  return {{"graph_module",
           {{"graph",
             {{"inputs", json::array()}, {"outputs", json::array({tensor_arg("linear_1")})}, {"nodes", nodes},
              {"tensor_values", tensor_values}, {"sym_int_values", json::object()}, {"sym_bool_values", json::object()},
              {"is_single_tensor_return", false}, {"custom_obj_values", json::object()}, {"sym_float_values", json::object()}}},
            {"signature",
             {{"input_specs", inputs},
              {"output_specs", json::array({{{"user_output", {{"arg", tensor_arg("linear_1")}}}}})}}},
            {"module_call_graph", json::array()},
            {"metadata", json::object()}}},
          {"opset_version", {{"aten", 10}}},
          {"range_constraints", range_constraints},
          {"schema_version", {{"major", 8}, {"minor", 17}}},
          {"verifiers", json::array({"TRAINING"})},
          {"torch_version", "2.11.0"},
          {"guards_code", json::array()}};
}

/// An archive's records: name (without the top folder) -> bytes.
using Records = std::map<std::string, std::string>;

/// The records of an archive holding `program` as "model" with `weights` (each its own file).
inline Records tiny_records(const json& program = tiny_program(),
                            const std::vector<std::pair<std::string, torch::Tensor>>& weights = tiny_weights()) {
  Records records{{"archive_format", "pt2"}, {"archive_version", "0"}, {"models/model.json", program.dump()}};
  json config = json::object();
  for (size_t i = 0; i < weights.size(); ++i) {
    const auto& [name, tensor] = weights[i];
    const auto file = "weight_" + std::to_string(i);
    const bool parameter = tensor.scalar_type() != torch::kLong && name.find("running") == std::string::npos;
    config[name] = {{"path_name", file}, {"is_param", parameter}, {"use_pickle", false},
                    {"tensor_meta", tensor_meta(tensor.sizes().vec(), tensor.scalar_type() == torch::kLong ? 5 : 7, parameter)}};
    const auto contiguous = tensor.contiguous();
    records["data/weights/" + file] = std::string(static_cast<const char*>(contiguous.data_ptr()), contiguous.nbytes());
  }
  records["data/weights/model_weights_config.json"] = json{{"config", config}}.dump();
  records["data/constants/model_constants_config.json"] = json{{"config", json::object()}}.dump();
  return records;
}

/// Writes `records` as a zip archive with libtorch's writer (top folder "archive").
inline void write_archive(const std::filesystem::path& path, const Records& records) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  caffe2::serialize::PyTorchStreamWriter writer([&out](const void* data, size_t size) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
    return size;
  });
  for (const auto& [name, bytes] : records) writer.writeRecord(name, bytes.data(), bytes.size());
  writer.writeEndOfFile();
}

}  // namespace pt2_fixture
