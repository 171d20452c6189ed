// flop_count.hpp: the FLOPs of a model's forward pass, counted from the ops it really runs
// (libtorch's RecordFunction observers with inputs), so an achieved-GFLOP/s figure needs no
// hand-written formula per architecture.
//
// Counted, by the usual convention for "model FLOPs": 2 x multiply-adds of every convolution
// (aten::convolution: 2 N Cout Hout Wout Cin/groups kh kw) and matrix product (aten::addmm,
// aten::mm, aten::bmm). Normalisation, activations, pooling and the optimizer are left out (a few
// percent of a CNN's arithmetic). A training step is taken as 3x the forward: the backward
// computes the gradients of the inputs and of the weights, each as much work as the forward.
#pragma once

#include <ATen/record_function.h>
#include <torch/torch.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string_view>

namespace bench {

namespace flop_count_detail {

inline std::atomic<double>& counted() {
  static std::atomic<double> flops{0.0};
  return flops;
}

/// Output size of one spatial dimension of a convolution.
inline int64_t conv_output(int64_t in, int64_t kernel, int64_t stride, int64_t pad, int64_t dilation) {
  return (in + 2 * pad - dilation * (kernel - 1) - 1) / stride + 1;
}

inline double convolution_flops(const c10::ArrayRef<const c10::IValue>& in) {
  // aten::convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
  const auto& x = in[0].toTensor();
  const auto& w = in[1].toTensor();
  const auto stride = in[3].toIntVector();
  const auto padding = in[4].toIntVector();
  const auto dilation = in[5].toIntVector();
  const int64_t groups = in[8].toInt();
  double outputs = static_cast<double>(x.size(0)) * static_cast<double>(w.size(0));
  for (int64_t d = 2; d < x.dim(); ++d) {
    const auto i = static_cast<size_t>(d - 2);
    const auto pick = [&](const std::vector<int64_t>& v) { return v.size() == 1 ? v[0] : v[i]; };
    outputs *= static_cast<double>(conv_output(x.size(d), w.size(d), pick(stride), pick(padding), pick(dilation)));
  }
  double per_output = static_cast<double>(x.size(1) / groups);
  for (int64_t d = 2; d < w.dim(); ++d) per_output *= static_cast<double>(w.size(d));
  return 2.0 * outputs * per_output;
}

inline std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const std::string_view name = fn.name();
  const auto in = fn.inputs();
  double flops = 0.0;
  if (name == "aten::convolution") {
    flops = convolution_flops(in);
  } else if (name == "aten::addmm") {  // (bias, a [M,K], b [K,N])
    const auto& a = in[1].toTensor();
    const auto& b = in[2].toTensor();
    flops = 2.0 * static_cast<double>(a.size(0)) * static_cast<double>(a.size(1)) * static_cast<double>(b.size(1));
  } else if (name == "aten::mm") {
    const auto& a = in[0].toTensor();
    const auto& b = in[1].toTensor();
    flops = 2.0 * static_cast<double>(a.size(0)) * static_cast<double>(a.size(1)) * static_cast<double>(b.size(1));
  } else if (name == "aten::bmm") {
    const auto& a = in[0].toTensor();
    const auto& b = in[1].toTensor();
    flops = 2.0 * static_cast<double>(a.size(0) * a.size(1)) * static_cast<double>(a.size(2)) *
            static_cast<double>(b.size(2));
  }
  if (flops > 0) {
    double now = counted().load();
    while (!counted().compare_exchange_weak(now, now + flops)) {
    }
  }
  return nullptr;
}

}  // namespace flop_count_detail

/// @brief FLOPs of one forward pass of `model` on `input` (no gradients, eval mode, restored
/// after), counted from the convolutions and matrix products it runs.
template <class Model>
double forward_flops(Model& model, const torch::Tensor& input) {
  flop_count_detail::counted() = 0.0;
  const bool was_training = model->is_training();
  model->eval();
  const auto handle = at::addGlobalCallback(
      at::RecordFunctionCallback(&flop_count_detail::on_start).needsInputs(true).scopes({at::RecordScope::FUNCTION}));
  {
    torch::NoGradGuard no_grad;
    model->forward(input);
  }
  at::removeCallback(handle);
  model->train(was_training);
  return flop_count_detail::counted().load();
}

/// @brief FLOPs of one training step per sample: 3x the forward's (see the file comment).
template <class Model>
double training_flops_per_sample(Model& model, const torch::Tensor& batch) {
  return 3.0 * forward_flops(model, batch) / static_cast<double>(batch.size(0));
}

}  // namespace bench
