#pragma once
/// @file
/// @brief SyncBatchNorm: batch normalisation over the global batch of every DDP rank (PyTorch's
/// SyncBatchNorm, Lightning's `sync_batchnorm=True`, fastai's DistributedTrainer default).
///
/// A drop-in for torch::nn::BatchNorm1d/2d/3d, with the same parameters and buffers under the same
/// names (weight, bias, running_mean, running_var, num_batches_tracked), so checkpoints load either
/// way. C++ modules are typed members, so no one can swap a model's layers from outside as
/// Python's convert_sync_batchnorm does: declare this type in the model instead.
///
/// @code
/// struct NetImpl : torch::nn::Module {
///   trainloop::nn::SyncBatchNorm bn{register_module("bn", trainloop::nn::SyncBatchNorm(64))};
///   ...
/// };
/// trainloop::TrainLoopOptions().sync_batchnorm(true);   // ddp: statistics of the global batch
/// @endcode
///
/// In training under DDP with TrainLoopOptions::sync_batchnorm, the forward all-reduces each
/// channel's sum, sum of squares and count (so uneven shards weigh exactly by their samples) and
/// the backward all-reduces the two sums the input gradient needs: the result equals one process
/// with the combined batch. Otherwise (one process, DataParallel replicas, evaluation) it is
/// exactly torch's batch norm.

#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <functional>
#include <vector>

namespace trainloop::nn {

namespace detail {

/// The all-reduce (sum, in place) the layers use while a DDP fit with sync_batchnorm runs; empty
/// otherwise. Set by the training loop (SyncBatchNormScope), process-wide: the forward and
/// backward of a DDP rank run in its training thread.
inline std::function<void(torch::Tensor&)>& sync_batchnorm_all_reduce() {
  static std::function<void(torch::Tensor&)> reduce;
  return reduce;
}

/// Turns the cross-rank statistics on for its lifetime.
class SyncBatchNormScope {
 public:
  explicit SyncBatchNormScope(std::function<void(torch::Tensor&)> reduce) { sync_batchnorm_all_reduce() = std::move(reduce); }
  ~SyncBatchNormScope() { sync_batchnorm_all_reduce() = nullptr; }
  SyncBatchNormScope(const SyncBatchNormScope&) = delete;
  SyncBatchNormScope& operator=(const SyncBatchNormScope&) = delete;
};

/// Shape [1, C, 1, ...] to broadcast a per-channel vector over an input of `dim` dimensions.
inline std::vector<int64_t> channel_shape(int64_t channels, int64_t dim) {
  std::vector<int64_t> shape(static_cast<size_t>(dim), 1);
  shape[1] = channels;
  return shape;
}

/// Every dimension but the channels'.
inline std::vector<int64_t> reduce_dims(int64_t dim) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < dim; ++d) dims.push_back(d);
  return dims;
}

/// Normalisation with global statistics; its backward reduces the input gradient's two sums.
/// Inputs: x, mean, invstd (per channel, from the forward's all-reduce), weight, bias, count.
struct GlobalBatchNormFunction : torch::autograd::Function<GlobalBatchNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& mean,
                               const torch::Tensor& invstd, const torch::Tensor& weight, const torch::Tensor& bias,
                               double count) {
    const auto shape = channel_shape(x.size(1), x.dim());
    auto xhat = (x - mean.view(shape)) * invstd.view(shape);
    ctx->save_for_backward({xhat, invstd, weight});
    ctx->saved_data["count"] = count;
    ctx->saved_data["affine"] = weight.defined();
    auto y = weight.defined() ? xhat * weight.view(shape) + bias.view(shape) : xhat;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& xhat = saved[0];
    const auto& invstd = saved[1];
    const auto& weight = saved[2];
    const double count = ctx->saved_data["count"].toDouble();
    const auto& dy = grads[0];
    const auto shape = channel_shape(xhat.size(1), xhat.dim());
    const auto dims = reduce_dims(xhat.dim());
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xhat = (dy * xhat).sum(dims);
    // Parameter gradients stay local: DDP's gradient reducer averages them like any other.
    torch::Tensor grad_weight, grad_bias;
    if (ctx->saved_data["affine"].toBool()) {
      grad_weight = sum_dy_xhat.clone();
      grad_bias = sum_dy.clone();
    }
    // The input gradient needs the sums over the global batch.
    auto both = torch::cat({sum_dy, sum_dy_xhat}).to(torch::kFloat64);
    if (auto& reduce = sync_batchnorm_all_reduce()) reduce(both);
    both = both.to(dy.scalar_type());  // dy is float32 or float64 here (the forward computes in at least float32)
    const int64_t c = xhat.size(1);
    const auto global_dy = both.narrow(0, 0, c).view(shape), global_dy_xhat = both.narrow(0, c, c).view(shape);
    auto scale = invstd.view(shape);
    if (weight.defined()) scale = scale * weight.view(shape);
    auto dx = scale * (dy - global_dy / count - xhat * global_dy_xhat / count);
    return {dx, torch::Tensor(), torch::Tensor(), grad_weight, grad_bias, torch::Tensor()};
  }
};

}  // namespace detail

/// @brief Batch normalisation over the global batch of every DDP rank (see the file comment).
class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl> {
 public:
  /// @param features channels (C of an N x C x ... input)
  explicit SyncBatchNormImpl(int64_t features) : SyncBatchNormImpl(torch::nn::BatchNormOptions(features)) {}
  /// @brief With torch's BatchNorm options (eps, momentum, affine, track_running_stats).
  explicit SyncBatchNormImpl(torch::nn::BatchNormOptions options) : options(std::move(options)) { reset(); }

  /// @brief (Re)creates the parameters and buffers (Cloneable uses it to copy the module).
  void reset() override {
    if (options.affine()) {
      weight = register_parameter("weight", torch::ones({options.num_features()}));
      bias = register_parameter("bias", torch::zeros({options.num_features()}));
    }
    if (options.track_running_stats()) {
      running_mean = register_buffer("running_mean", torch::zeros({options.num_features()}));
      running_var = register_buffer("running_var", torch::ones({options.num_features()}));
      num_batches_tracked = register_buffer("num_batches_tracked", torch::tensor(0, torch::kLong));
    }
  }

  /// @brief Normalises an N x C x ... input.
  torch::Tensor forward(const torch::Tensor& input) {
    TRAINLOOP_CHECK(input.dim() >= 2 && input.size(1) == options.num_features(), "SyncBatchNorm of ",
                    options.num_features(), " features got an input of shape ", input.sizes(), "; expected N x ",
                    options.num_features(), " x ...");
    const bool use_batch_stats = is_training() || !options.track_running_stats();
    auto& reduce = detail::sync_batchnorm_all_reduce();
    double average = 0.0;  // the running statistics' update factor, as torch's BatchNorm computes it
    if (is_training() && options.track_running_stats()) {
      num_batches_tracked += 1;
      average = options.momentum() ? *options.momentum() : 1.0 / num_batches_tracked.item<double>();
    }
    // Only training batches are synchronised (as PyTorch): validation shards are not padded, so
    // ranks may run different numbers of evaluation batches and must not meet in a collective.
    if (!use_batch_stats || !reduce || !is_training()) {
      return torch::batch_norm(input, weight, bias, running_mean, running_var, use_batch_stats, average, options.eps(),
                               at::globalContext().userEnabledCuDNN());
    }
    // Global statistics: every rank's sums and counts, in float64.
    const auto dims = detail::reduce_dims(input.dim());
    const int64_t c = options.num_features();
    torch::Tensor mean, invstd, var;
    double count = 0.0;
    {
      torch::NoGradGuard no_grad;
      const auto x = input.detach().to(torch::kFloat64);
      auto packed = torch::cat({x.sum(dims), (x * x).sum(dims),
                                torch::full({1}, static_cast<double>(input.numel() / c), x.options())});
      reduce(packed);
      count = packed[2 * c].item<double>();
      TRAINLOOP_CHECK(count > 1, "SyncBatchNorm saw ", count, " values per channel over all ranks; expected more than 1");
      mean = packed.narrow(0, 0, c) / count;
      var = (packed.narrow(0, c, c) / count - mean * mean).clamp_min(0.0);
      invstd = (var + options.eps()).rsqrt();
      if (options.track_running_stats()) {
        running_mean.mul_(1.0 - average).add_(mean.to(running_mean.scalar_type()), average);
        running_var.mul_(1.0 - average).add_((var * (count / (count - 1.0))).to(running_var.scalar_type()), average);
      }
    }
    // Normalised in at least float32 (under bf16/fp16 autocast too, as torch's batch norm does),
    // returned in the input's type.
    const auto compute = input.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
    auto output = detail::GlobalBatchNormFunction::apply(input.to(compute), mean.to(compute), invstd.to(compute),
                                                         weight.defined() ? weight.to(compute) : weight,
                                                         bias.defined() ? bias.to(compute) : bias, count);
    return output.to(input.scalar_type());
  }

  /// @brief The options.
  torch::nn::BatchNormOptions options;
  /// @brief Scale (when affine).
  torch::Tensor weight;
  /// @brief Shift (when affine).
  torch::Tensor bias;
  /// @brief Running mean (when tracking running statistics).
  torch::Tensor running_mean;
  /// @brief Running (unbiased) variance.
  torch::Tensor running_var;
  /// @brief Training batches seen.
  torch::Tensor num_batches_tracked;
};
/// @brief Holder of SyncBatchNormImpl (TORCH_MODULE).
TORCH_MODULE(SyncBatchNorm);

}  // namespace trainloop::nn
