#pragma once
/// @file
/// @brief PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, 2019; PyTorch's
/// `powerSGD_hook`): each gradient matrix M (n x m, a convolution's kernel reshaped to
/// out x rest) travels as two thin factors of rank r, P (n x r) and Q (m x r), instead of n·m
/// values.
///
/// Per matrix and step, on every rank: M += error (error feedback: what earlier steps' compression
/// left out is sent later); P = M Q; all-reduce P; orthonormalise P's columns; Q = Mᵀ P; all-reduce
/// Q; the mean gradient is approximated by P Qᵀ and error = M - P Qᵀ / W (this rank's share). Q is kept for the next step
/// (warm start: one power iteration per step keeps improving the subspace). The bucket holds this
/// rank's gradient already divided by the world size, so the sums are means. Biases, and matrices
/// that would shrink less than `min_compression_rate` times, are all-reduced as they are. The first `start_iteration` steps
/// all-reduce everything uncompressed (PyTorch's `start_powerSGD_iter`: compression from the start
/// slows early training). At full rank (r ≥ min(n, m)) P Qᵀ is the exact mean (tested within 1e-4).
///
/// Q starts from a seeded generator, the same on every rank. Two collectives per bucket run one
/// after the other (P's result is needed for Q): launch() starts P's all-reduce (and the
/// uncompressed tensors') and returns a CommFuture whose second round computes Q once P arrived
/// and all-reduces it, and whose finishing step writes P Qᵀ: nothing waits on the autograd thread
/// (gradient_comm_hook.hpp says where each part runs). Its state (the step count, Q and
/// the error, per rank) is rebuilt when the reducer's buckets change, and is in DDP's checkpoints
/// (save_state / load_state), so a resumed run equals an uninterrupted one.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>
#include <trainloop/error.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

namespace trainloop::distributed {

/// Settings of PowerSgdHook.
struct PowerSgdOptions {
  /// Rank r of the factors P and Q: more is closer to the all-reduce, fewer bytes is less.
  TORCH_ARG(std::int64_t, rank) = 1;
  /// Steps all-reduced uncompressed before compression starts.
  TORCH_ARG(std::int64_t, start_iteration) = 10;
  /// Seed of Q's first values (the same on every rank).
  TORCH_ARG(std::uint64_t, seed) = 0;
  /// Compress an n x m gradient only when n·m ≥ this x r·(n+m) (PyTorch's `min_compression_rate`);
  /// the others travel whole. 0 compresses every matrix (at full rank: to check the algorithm).
  TORCH_ARG(double, min_compression_rate) = 2.0;
};

/// PowerSGD (see the file comment).
class PowerSgdHook : public GradientCommHook {
 public:
  /// @throws trainloop::ConfigurationError when the rank is below 1 or the start iteration negative.
  explicit PowerSgdHook(PowerSgdOptions options = {}) : options_(options) { validate(options_); }

  /// @throws trainloop::ConfigurationError naming the first setting out of range.
  static void validate(const PowerSgdOptions& options) {
    if (options.rank() < 1) {
      throw ConfigurationError(::trainloop::detail::concat("trainloop: PowerSGD rank is ", options.rank(),
                                                           "; expected 1 or more"));
    }
    if (options.start_iteration() < 0) {
      throw ConfigurationError(::trainloop::detail::concat("trainloop: PowerSGD start iteration is ",
                                                           options.start_iteration(), "; expected 0 or more"));
    }
  }

  /// Plans, per bucket, which gradients are compressed (as n x m matrices) and which travel whole.
  void on_buckets_formed(const std::vector<BucketLayout>& buckets) override {
    buckets_.clear();
    for (const auto& layout : buckets) {
      Bucket bucket;
      for (std::size_t i = 0; i < layout.shapes.size(); ++i) {
        const auto& shape = layout.shapes[i];
        std::int64_t numel = 1;
        for (auto d : shape) numel *= d;
        const std::int64_t n = shape.empty() ? 1 : shape[0];
        const std::int64_t m = n == 0 ? 0 : numel / n;
        const std::int64_t r = std::min({options_.rank(), n, m});
        if (shape.size() >= 2 && r > 0 &&
            static_cast<double>(n * m) >= options_.min_compression_rate() * static_cast<double>(r * (n + m))) {
          bucket.matrices.push_back(Matrix{layout.offsets[i], n, m, r, {}, {}, {}});
        } else {
          bucket.whole.push_back({layout.offsets[i], numel});
        }
      }
      buckets_.push_back(std::move(bucket));
    }
    steps_ = 0;
  }

  /// Compresses bucket `index` (or all-reduces it whole during the first steps).
  CommFuture launch(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) override {
    TRAINLOOP_CHECK(index < buckets_.size(), "PowerSGD got bucket #", index, " but knows ", buckets_.size(),
                    "; expected the hook to be attached with GradientReducer::set_comm_hook");
    torch::NoGradGuard no_grad;
    if (index == 0) ++steps_;
    Bucket& bucket = buckets_[index];
    bucket.compressed_this_step = steps_ > options_.start_iteration() && !bucket.matrices.empty();
    const auto bytes = [&](std::int64_t numel) {
      return ring_all_reduce_bytes(numel * static_cast<std::int64_t>(flat.element_size()), group.world_size());
    };
    if (!bucket.compressed_this_step) {
      bucket.sent = bytes(flat.numel());
      return CommFuture(group.all_reduce_sum_async(flat));
    }
    // Tensors that travel whole, in one buffer, while the factors are computed.
    std::int64_t whole_numel = 0;
    for (const auto& w : bucket.whole) whole_numel += w.numel;
    if (!bucket.whole_buffer.defined()) bucket.whole_buffer = torch::empty({whole_numel}, flat.options());
    for (std::int64_t at = 0; const auto& w : bucket.whole) {
      bucket.whole_buffer.narrow(0, at, w.numel).copy_(flat.narrow(0, w.offset, w.numel));
      at += w.numel;
    }
    bucket.whole_work = whole_numel > 0 ? group.all_reduce_sum_async(bucket.whole_buffer) : WorkHandle();
    // P = M Q for every matrix, all-reduced as one buffer.
    std::int64_t p_numel = 0, q_numel = 0;
    for (const auto& mat : bucket.matrices) p_numel += mat.n * mat.r, q_numel += mat.m * mat.r;
    if (!bucket.ps.defined()) {  // once per bucket layout (on_buckets_formed starts a new one)
      bucket.ps = torch::empty({p_numel}, flat.options());
      bucket.qs = torch::empty({q_numel}, flat.options());
    }
    for (std::int64_t p_at = 0; auto& mat : bucket.matrices) {
      torch::Tensor m = flat.narrow(0, mat.offset, mat.n * mat.m).view({mat.n, mat.m});
      if (!mat.error.defined()) {
        mat.error = torch::zeros_like(m);
        torch::Generator generator = at::detail::createCPUGenerator(options_.seed() + static_cast<std::uint64_t>(mat.offset));
        mat.q = torch::randn({mat.m, mat.r}, generator, torch::TensorOptions().dtype(flat.dtype())).to(flat.device());
      }
      m.add_(mat.error);  // error feedback, in the bucket itself: M is now what this rank must send
      torch::Tensor p = bucket.ps.narrow(0, p_at, mat.n * mat.r).view({mat.n, mat.r});
      torch::matmul_out(p, m, mat.q);
      p_at += mat.n * mat.r;
    }
    bucket.sent = bytes(whole_numel) + bytes(p_numel) + bytes(q_numel);
    ProcessGroup* const reducer_group = &group;  // lives as long as the reducer that calls us
    return CommFuture(group.all_reduce_sum_async(bucket.ps))
        .then([this, reducer_group, index, flat] { return all_reduce_q(*reducer_group, index, flat); })
        .then([this, reducer_group, index, flat] { write_approximation(*reducer_group, index, flat); });
  }

  /// The bytes of the last launch of bucket `index`: P, Q and the whole tensors, or the bucket.
  std::int64_t bytes_sent(std::size_t index, const torch::Tensor& /*flat*/, int /*world_size*/) const override {
    return buckets_.at(index).sent;
  }

  /// The step count, and each compressed matrix's Q and error once it has them ("b<bucket>m<k>q", "...e").
  void save_state(torch::serialize::OutputArchive& archive) const override {
    archive.write("steps", torch::full({1}, steps_, torch::kInt64));
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t k = 0; k < buckets_[b].matrices.size(); ++k) {
        const Matrix& mat = buckets_[b].matrices[k];
        if (!mat.error.defined()) continue;
        const std::string key = ::trainloop::detail::concat("b", b, "m", k);  // concat: GCC 12 warns (-Wrestrict) on "b" + to_string
        archive.write(key + "q", mat.q);
        archive.write(key + "e", mat.error);
      }
    }
  }
  /// Restores what save_state() wrote; a matrix without saved state starts afresh, as it would
  /// have. A state that does not fit these buckets (another model, bucket cap, trainable set or
  /// PowerSGD rank) is not applied at all: PowerSGD starts afresh, with a warning.
  void load_state(torch::serialize::InputArchive& archive) override {
    torch::Tensor steps;
    if (!archive.try_read("steps", steps)) return;
    struct Loaded {
      Matrix* matrix;
      torch::Tensor q, error;
    };
    std::vector<Loaded> loaded;
    for (std::size_t b = 0; b < buckets_.size(); ++b) {
      for (std::size_t k = 0; k < buckets_[b].matrices.size(); ++k) {
        Matrix& mat = buckets_[b].matrices[k];
        const std::string key = ::trainloop::detail::concat("b", b, "m", k);  // concat: GCC 12 warns (-Wrestrict) on "b" + to_string
        torch::Tensor q, error;
        if (!archive.try_read(key + "q", q) || !archive.try_read(key + "e", error)) continue;
        if (q.sizes() != torch::IntArrayRef{mat.m, mat.r} || error.sizes() != torch::IntArrayRef{mat.n, mat.m}) {
          std::cerr << "trainloop: warning: the PowerSGD state in the checkpoint does not fit this run (bucket " << b
                    << " matrix " << k << ": Q " << q.sizes() << ", error " << error.sizes() << "; expected [" << mat.m
                    << ", " << mat.r << "] and [" << mat.n << ", " << mat.m << "]); PowerSGD starts afresh\n";
          return;
        }
        loaded.push_back({&mat, q, error});
      }
    }
    for (auto& entry : loaded) {
      entry.matrix->q = entry.q;
      entry.matrix->error = entry.error;
    }
    steps_ = steps.item<std::int64_t>();
  }

 private:
  /// The second round, once P's sum arrived: orthonormal P, then Q = Mᵀ P, all-reduced as one buffer.
  CommFuture all_reduce_q(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) {
    torch::NoGradGuard no_grad;
    Bucket& bucket = buckets_.at(index);
    for (std::int64_t p_at = 0, q_at = 0; auto& mat : bucket.matrices) {
      torch::Tensor p = bucket.ps.narrow(0, p_at, mat.n * mat.r).view({mat.n, mat.r});
      mat.p = std::get<0>(torch::linalg_qr(p, "reduced"));
      torch::Tensor m = flat.narrow(0, mat.offset, mat.n * mat.m).view({mat.n, mat.m});
      torch::Tensor q = bucket.qs.narrow(0, q_at, mat.m * mat.r).view({mat.m, mat.r});
      torch::matmul_out(q, m.t(), mat.p);
      p_at += mat.n * mat.r;
      q_at += mat.m * mat.r;
    }
    return CommFuture(group.all_reduce_sum_async(bucket.qs));
  }

  /// The finishing step: writes P Qᵀ (and the whole tensors' mean) into the bucket and keeps this
  /// rank's error and Q.
  void write_approximation(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) {
    torch::NoGradGuard no_grad;
    Bucket& bucket = buckets_.at(index);
    for (std::int64_t q_at = 0; auto& mat : bucket.matrices) {
      torch::Tensor m = flat.narrow(0, mat.offset, mat.n * mat.m).view({mat.n, mat.m});
      mat.q = bucket.qs.narrow(0, q_at, mat.m * mat.r).view({mat.m, mat.r}).clone();  // warm start
      torch::Tensor approximation = torch::matmul(mat.p, mat.q.t());
      // What this rank's M had beyond its share of the approximated sum (PyTorch's error, which is in
      // un-divided gradients: M·W - mean, here divided by W like the bucket).
      torch::sub_out(mat.error, m, approximation / static_cast<double>(group.world_size()));
      m.copy_(approximation);
      q_at += mat.m * mat.r;
    }
    if (bucket.whole_work) group.wait(bucket.whole_work, "PowerSGD all-reduce of the uncompressed gradients");
    bucket.whole_work.reset();
    for (std::int64_t at = 0; const auto& w : bucket.whole) {
      flat.narrow(0, w.offset, w.numel).copy_(bucket.whole_buffer.narrow(0, at, w.numel));
      at += w.numel;
    }
  }

  struct Matrix {
    std::int64_t offset, n, m, r;
    torch::Tensor q, error;  // kept across steps
    torch::Tensor p;         // this step's orthonormal P
  };
  struct Whole {
    std::int64_t offset, numel;
  };
  struct Bucket {
    std::vector<Matrix> matrices;
    std::vector<Whole> whole;
    bool compressed_this_step = false;
    torch::Tensor ps, qs, whole_buffer;  // reused every step
    WorkHandle whole_work;
    std::int64_t sent = 0;
  };

  PowerSgdOptions options_;
  std::vector<Bucket> buckets_;
  std::int64_t steps_ = 0;
};

}  // namespace trainloop::distributed
