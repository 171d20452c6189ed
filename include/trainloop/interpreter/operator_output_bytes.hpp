#pragma once
/// @file
/// @brief What an allowed operator's results will hold, in bytes, from its arguments, before its
/// kernel runs: a GraphProgram run (graph_program.hpp) refuses a node whose results would pass its
/// memory budget without making them.
///
/// Charging a node after its kernel ran (issue 50) let one node of a 2 KB program take what it
/// asked for first: `add(x.view(-1, 1), x.view(1, -1))` of a 1 M-element input is 4 TB. Shape
/// inference on the Meta device would say it without a rule per operator, but libtorch's C++ has no
/// Meta kernel for conv2d, batch_norm, layer_norm, embedding, roll or scaled_dot_product_attention
/// (their Meta implementations are Python's; measured with libtorch 2.15), so each operator of the
/// allow-list (exported_operators.hpp) has a rule here, an upper bound of its results' bytes:
///
/// - views and in-place operators make nothing new: 0;
/// - elementwise operators, norms, reductions, copies and `cat`: at most their tensor arguments'
///   bytes (dropout twice that: its mask);
/// - broadcasting ones (`add`, `mul`, ...): the product of each aligned dimension's largest size;
/// - factories: their `size` argument's product, 8 bytes an element;
/// - the rest (conv2d, linear, matmul, einsum, attention, embedding, index, pad, pooling) from
///   their shapes as their kernels compute them (a pooling or convolution's window bounded by
///   its input and padding, so a rule never needs stride or dilation to be sane).
///
/// Kernels' own workspaces are not charged, and an operator a user allowed
/// (allow_exported_operator) has no rule: it is charged after it runs. A test checks every
/// operator of the list has a rule and that each rule bounds what the kernel makes.

#include <ATen/core/ivalue.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace trainloop::serialization {

/// @brief An upper bound of the bytes an operator's results will hold, from its boxed arguments
/// (in its schema's order); saturates at INT64_MAX.
using OperatorOutputBytes = int64_t (*)(const std::vector<c10::IValue>& stack);

namespace detail {

constexpr int64_t kBytesMax = std::numeric_limits<int64_t>::max();

inline int64_t saturating_mul(int64_t a, int64_t b) {
  if (a <= 0 || b <= 0) return 0;
  return a > kBytesMax / b ? kBytesMax : a * b;
}
inline int64_t saturating_add(int64_t a, int64_t b) { return a > kBytesMax - b ? kBytesMax : a + b; }

/// The product of `sizes` (negative sizes count as 0: the kernel refuses them), saturating.
inline int64_t size_product(c10::IntArrayRef sizes) {
  int64_t product = 1;
  for (const int64_t size : sizes) product = saturating_mul(product, std::max<int64_t>(size, 0));
  return product;
}

/// The tensors among `value` (a tensor, a list of them, a list of optional ones).
inline std::vector<torch::Tensor> tensors_of(const c10::IValue& value) {
  std::vector<torch::Tensor> out;
  if (value.isTensor()) {
    out.push_back(value.toTensor());
  } else if (value.isTensorList()) {
    out = value.toTensorVector();
  } else if (value.isList()) {
    for (const c10::IValue& element : value.toListRef()) {
      if (element.isTensor()) out.push_back(element.toTensor());
    }
  }
  out.erase(std::remove_if(out.begin(), out.end(), [](const torch::Tensor& t) { return !t.defined(); }), out.end());
  return out;
}

inline std::vector<torch::Tensor> tensor_arguments(const std::vector<c10::IValue>& stack) {
  std::vector<torch::Tensor> all;
  for (const auto& value : stack) {
    auto some = tensors_of(value);
    all.insert(all.end(), some.begin(), some.end());
  }
  return all;
}

/// The largest element size among the tensor arguments (8 when there is none).
inline int64_t element_bytes(const std::vector<c10::IValue>& stack) {
  int64_t bytes = 0;
  for (const auto& tensor : tensor_arguments(stack)) bytes = std::max<int64_t>(bytes, static_cast<int64_t>(tensor.element_size()));
  return bytes == 0 ? 8 : bytes;
}

/// A tensor argument at `index`, or an undefined tensor.
inline torch::Tensor tensor_at(const std::vector<c10::IValue>& stack, size_t index) {
  return index < stack.size() && stack[index].isTensor() ? stack[index].toTensor() : torch::Tensor();
}

/// An int-list argument at `index`, or empty.
inline std::vector<int64_t> ints_at(const std::vector<c10::IValue>& stack, size_t index) {
  return index < stack.size() && stack[index].isIntList() ? stack[index].toIntVector() : std::vector<int64_t>{};
}

inline int64_t no_new_bytes(const std::vector<c10::IValue>&) { return 0; }

inline int64_t argument_bytes(const std::vector<c10::IValue>& stack) {
  int64_t bytes = 0;
  for (const auto& tensor : tensor_arguments(stack)) {
    bytes = saturating_add(bytes, saturating_mul(size_product(tensor.sizes()), static_cast<int64_t>(tensor.element_size())));
  }
  return bytes;
}

inline int64_t twice_argument_bytes(const std::vector<c10::IValue>& stack) {
  return saturating_mul(argument_bytes(stack), 2);
}

/// The sizes of all tensor arguments broadcast: each aligned (from the last) dimension's largest size.
inline int64_t broadcast_bytes(const std::vector<c10::IValue>& stack) {
  std::vector<int64_t> largest;  // from the last dimension
  for (const auto& tensor : tensor_arguments(stack)) {
    const auto sizes = tensor.sizes();
    if (sizes.size() > largest.size()) largest.resize(sizes.size(), 0);
    for (size_t i = 0; i < sizes.size(); ++i) largest[i] = std::max(largest[i], sizes[sizes.size() - 1 - i]);
  }
  return saturating_mul(size_product(largest), element_bytes(stack));
}

/// A factory's `size` argument at `index`, 8 bytes an element.
template <size_t index>
int64_t factory_bytes(const std::vector<c10::IValue>& stack) {
  return saturating_mul(size_product(ints_at(stack, index)), 8);
}

/// The leading sizes of `input` (all but its last `trailing`) times `tail`.
inline int64_t leading_times(const torch::Tensor& input, size_t trailing, int64_t tail) {
  if (!input.defined()) return 0;
  const auto sizes = input.sizes();
  const size_t keep = sizes.size() > trailing ? sizes.size() - trailing : 0;
  return saturating_mul(size_product(sizes.slice(0, keep)), tail);
}

/// A 2-D window's output (pooling, convolution): each of the last two sizes + twice its padding
/// (+ 1 for ceil mode), an upper bound whatever the kernel size, stride and dilation.
inline int64_t windowed_elements(const torch::Tensor& input, const std::vector<int64_t>& padding, int64_t channels) {
  if (!input.defined() || input.dim() < 2) return 0;
  int64_t spatial = 1;
  for (int64_t d = 0; d < 2; ++d) {
    const int64_t pad = padding.empty() ? 0 : padding[std::min<size_t>(static_cast<size_t>(d), padding.size() - 1)];
    spatial = saturating_mul(spatial, saturating_add(input.size(input.dim() - 2 + d), saturating_add(saturating_mul(std::max<int64_t>(pad, 0), 2), 1)));
  }
  const int64_t leading = leading_times(input, 3, 1);  // the batch, when there is one
  return saturating_mul(saturating_mul(leading, channels), spatial);
}

inline int64_t pooling_bytes(const std::vector<c10::IValue>& stack) {  // (self, kernel_size, stride, padding, ...)
  const torch::Tensor input = tensor_at(stack, 0);
  if (!input.defined() || input.dim() < 3) return 0;
  const int64_t elements = windowed_elements(input, ints_at(stack, 3), input.size(input.dim() - 3));
  return saturating_mul(elements, static_cast<int64_t>(input.element_size()) + 8);  // max pooling's indices
}

inline int64_t adaptive_pooling_bytes(const std::vector<c10::IValue>& stack) {  // (self, output_size)
  const torch::Tensor input = tensor_at(stack, 0);
  return saturating_mul(leading_times(input, 2, size_product(ints_at(stack, 1))), element_bytes(stack));
}

inline int64_t conv2d_bytes(const std::vector<c10::IValue>& stack) {  // (input, weight, bias, stride, padding, ...)
  const torch::Tensor input = tensor_at(stack, 0), weight = tensor_at(stack, 1);
  if (!weight.defined() || weight.dim() < 1) return 0;
  return saturating_mul(windowed_elements(input, ints_at(stack, 4), weight.size(0)), element_bytes(stack));
}

inline int64_t linear_bytes(const std::vector<c10::IValue>& stack) {  // (input, weight, bias)
  const torch::Tensor input = tensor_at(stack, 0), weight = tensor_at(stack, 1);
  const int64_t outputs = weight.defined() && weight.dim() == 2 ? weight.size(0) : 1;
  return saturating_mul(leading_times(input, 1, outputs), element_bytes(stack));
}

inline int64_t matmul_bytes(const std::vector<c10::IValue>& stack) {  // (self, other): batch dims broadcast
  const torch::Tensor a = tensor_at(stack, 0), b = tensor_at(stack, 1);
  if (!a.defined() || !b.defined()) return 0;
  std::vector<int64_t> batch;  // from the last batch dimension
  for (const auto& t : {a, b}) {
    const auto sizes = t.sizes();
    const size_t dims = sizes.size() > 2 ? sizes.size() - 2 : 0;
    if (dims > batch.size()) batch.resize(dims, 0);
    for (size_t i = 0; i < dims; ++i) batch[i] = std::max(batch[i], sizes[dims - 1 - i]);
  }
  const int64_t rows = a.dim() >= 2 ? a.size(-2) : 1, columns = b.dim() >= 2 ? b.size(-1) : 1;
  return saturating_mul(saturating_mul(size_product(batch), saturating_mul(rows, columns)), element_bytes(stack));
}

/// einsum's output: the product of the output labels' sizes (ellipsis dimensions broadcast), plus
/// its inputs (permuted copies); with three operands or more, an intermediate may hold every label:
/// their product. An equation that does not parse is the kernel's to refuse.
inline int64_t einsum_bytes(const std::vector<c10::IValue>& stack) {  // (equation, tensors, path)
  if (stack.size() < 2 || !stack[0].isString()) return 0;
  const std::string equation = stack[0].toStringRef();
  const auto operands = tensors_of(stack[1]);
  const auto arrow = equation.find("->");
  std::vector<std::string> terms(1);
  for (const char c : equation.substr(0, arrow)) {
    if (c == ',') terms.emplace_back();
    else if (c != ' ') terms.back() += c;
  }
  if (terms.size() != operands.size()) return argument_bytes(stack);
  std::map<char, int64_t> label_size;
  std::map<char, int> label_count;
  std::vector<int64_t> ellipsis;  // broadcast, from the last dimension
  for (size_t o = 0; o < terms.size(); ++o) {
    const std::string& term = terms[o];
    const torch::Tensor& t = operands[o];
    const auto dots = term.find("...");
    const int64_t letters = static_cast<int64_t>(std::count_if(term.begin(), term.end(), [](char c) { return c != '.'; }));
    const int64_t spread = dots == std::string::npos ? 0 : t.dim() - letters;  // the dimensions "..." covers
    if (spread < 0 || (dots == std::string::npos && letters != t.dim())) return argument_bytes(stack);
    int64_t dim = 0;
    for (size_t i = 0; i < term.size(); ++i) {
      if (term[i] != '.') {
        label_size[term[i]] = std::max(label_size[term[i]], t.size(dim++));
        ++label_count[term[i]];
        continue;
      }
      if (i != dots) return argument_bytes(stack);
      if (static_cast<size_t>(spread) > ellipsis.size()) ellipsis.resize(static_cast<size_t>(spread), 0);
      for (int64_t k = 0; k < spread; ++k) {
        int64_t& largest = ellipsis[static_cast<size_t>(spread - 1 - k)];
        largest = std::max(largest, t.size(dim++));
      }
      i += 2;
    }
  }
  int64_t output = size_product(ellipsis);
  for (const auto& [label, size] : label_size) {
    const bool kept = operands.size() >= 3 ? true
                      : arrow == std::string::npos ? label_count[label] == 1
                                                   : equation.find(label, arrow + 2) != std::string::npos;
    if (kept) output = saturating_mul(output, size);
  }
  return saturating_add(saturating_mul(output, element_bytes(stack)), argument_bytes(stack));
}

inline int64_t attention_bytes(const std::vector<c10::IValue>& stack) {  // (query, key, value, ...): out + logsumexp
  const torch::Tensor query = tensor_at(stack, 0), value = tensor_at(stack, 2);
  if (!query.defined() || !value.defined() || value.dim() < 1) return 0;
  const int64_t rows = leading_times(query, 1, 1);
  return saturating_add(saturating_mul(saturating_mul(rows, value.size(-1)), element_bytes(stack)), saturating_mul(rows, 8));
}

inline int64_t embedding_bytes(const std::vector<c10::IValue>& stack) {  // (weight, indices, ...)
  const torch::Tensor weight = tensor_at(stack, 0), indices = tensor_at(stack, 1);
  if (!weight.defined() || !indices.defined()) return 0;
  const int64_t row = weight.dim() >= 2 ? size_product(weight.sizes().slice(1)) : 1;
  return saturating_mul(saturating_mul(size_product(indices.sizes()), row), static_cast<int64_t>(weight.element_size()));
}

/// index.Tensor: the indices' shapes broadcast (a mask as its element count) times the dimensions
/// no index covers.
inline int64_t index_bytes(const std::vector<c10::IValue>& stack) {  // (self, indices)
  const torch::Tensor self = tensor_at(stack, 0);
  if (!self.defined() || stack.size() < 2 || !stack[1].isList()) return 0;
  std::vector<int64_t> broadcast;  // from the last dimension
  int64_t dim = 0, covered = 1;
  for (const c10::IValue& entry : stack[1].toListRef()) {
    if (!entry.isTensor() || !entry.toTensor().defined()) {
      ++dim;
      continue;
    }
    const torch::Tensor& index = entry.toTensor();
    const bool mask = index.scalar_type() == torch::kBool || index.scalar_type() == torch::kByte;
    const std::vector<int64_t> shape = mask ? std::vector<int64_t>{size_product(index.sizes())} : index.sizes().vec();
    if (shape.size() > broadcast.size()) broadcast.resize(shape.size(), 0);
    for (size_t i = 0; i < shape.size(); ++i) broadcast[i] = std::max(broadcast[i], shape[shape.size() - 1 - i]);
    for (int64_t k = 0; k < (mask ? index.dim() : 1) && dim < self.dim(); ++k) covered = saturating_mul(covered, self.size(dim++));
  }
  const int64_t rest = covered == 0 ? 0 : size_product(self.sizes()) / covered;
  return saturating_mul(saturating_mul(size_product(broadcast), rest), static_cast<int64_t>(self.element_size()));
}

inline int64_t pad_bytes(const std::vector<c10::IValue>& stack) {  // (self, pad, mode, value)
  const torch::Tensor self = tensor_at(stack, 0);
  if (!self.defined()) return 0;
  std::vector<int64_t> sizes = self.sizes().vec();
  const auto pad = ints_at(stack, 1);
  for (size_t p = 0; p + 1 < pad.size() && p / 2 < sizes.size(); p += 2) {
    int64_t& size = sizes[sizes.size() - 1 - p / 2];
    size = saturating_add(size, std::max<int64_t>(pad[p], 0));
    size = saturating_add(size, std::max<int64_t>(pad[p + 1], 0));
  }
  return saturating_mul(size_product(sizes), static_cast<int64_t>(self.element_size()));
}

}  // namespace detail

/// @brief The rule bounding `qualified`'s ("aten::name.overload") results' bytes before it runs,
/// or null for an operator without one (a user's addition: charged after it runs).
inline OperatorOutputBytes operator_output_bytes(const std::string& qualified) {
  using namespace detail;
  static const std::map<std::string, OperatorOutputBytes> rules = [] {
    std::map<std::string, OperatorOutputBytes> r;
    for (const char* name : {"add_.Tensor", "chunk.default", "div_.Tensor", "expand.default", "fill_.Scalar", "fill_.Tensor",
                             "hardswish_.default", "permute.default", "relu_.default", "select.int", "silu_.default",
                             "slice.Tensor", "split_with_sizes.default", "squeeze.dim", "swapaxes.default", "transpose.int",
                             "unbind.int", "unflatten.int", "unsqueeze.default", "view.default"}) {
      r[std::string("aten::") + name] = &no_new_bytes;
    }
    for (const char* name : {"batch_norm.default", "bernoulli_.float", "cat.default", "contiguous.default", "eq.Scalar",
                             "flatten.using_ints", "gelu.default", "hardsigmoid.default", "layer_norm.default",
                             "lift_fresh_copy.default", "mean.dim", "ne.Scalar", "relu.default", "reshape.default", "roll.default",
                             "sigmoid.default", "silu.default", "softmax.int", "tanh.default", "triu.default"}) {
      r[std::string("aten::") + name] = &argument_bytes;
    }
    for (const char* name : {"dropout.default", "dropout_.default"}) r[std::string("aten::") + name] = &twice_argument_bytes;
    for (const char* name : {"add.Tensor", "masked_fill.Scalar", "mul.Tensor", "sub.Tensor"}) {
      r[std::string("aten::") + name] = &broadcast_bytes;
    }
    r["aten::empty.memory_format"] = &factory_bytes<0>;
    r["aten::full.default"] = &factory_bytes<0>;
    r["aten::new_zeros.default"] = &factory_bytes<1>;
    r["aten::adaptive_avg_pool2d.default"] = &adaptive_pooling_bytes;
    r["aten::avg_pool2d.default"] = &pooling_bytes;
    r["aten::max_pool2d.default"] = &pooling_bytes;
    r["aten::conv2d.default"] = &conv2d_bytes;
    r["aten::linear.default"] = &linear_bytes;
    r["aten::matmul.default"] = &matmul_bytes;
    r["aten::einsum.default"] = &einsum_bytes;
    r["aten::scaled_dot_product_attention.default"] = &attention_bytes;
    r["aten::embedding.default"] = &embedding_bytes;
    r["aten::index.Tensor"] = &index_bytes;
    r["aten::pad.default"] = &pad_bytes;
    return r;
  }();
  const auto found = rules.find(qualified);
  return found == rules.end() ? nullptr : found->second;
}

}  // namespace trainloop::serialization
