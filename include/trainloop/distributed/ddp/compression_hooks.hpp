#pragma once
/// @file
/// @brief Gradient compression for DDP: every bucket travels in 16 bits (PyTorch's
/// `fp16_compress_hook` and `bf16_compress_hook`), half the bytes of fp32 on the wire.
///
/// The bucket holds this rank's gradients already divided by the world size, so the values cast
/// to 16 bits are those of the mean, and the sum of W of them stays in range (fp16's largest value
/// is 65,504; a gradient mean beyond that is not a training that 16-bit compression suits).
/// fp16 keeps 11 significant bits and a narrow range; bf16 keeps fp32's range and 8 bits.
///
/// bf16 over Gloo: libtorch 1.13's Gloo cannot sum bf16 (its all-reduce has no bf16 type), so the
/// bf16 values travel by an all-gather of their bits (viewed as 16-bit halves, which Gloo moves
/// without arithmetic) and every rank sums the W rows in fp32, in rank order — the same sum on
/// every rank. A ring all-gather sends (W-1) x the bucket's 16-bit size per rank against
/// 2(W-1)/W x for an all-reduce: the same bytes as fp16 for 2 ranks, more beyond (GradientReducer::
/// last_step_bytes_sent() counts what really goes). NCCL sums bf16 itself.

#include <trainloop/distributed/comm/process_group.hpp>
#include <trainloop/distributed/ddp/gradient_comm_hook.hpp>

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <map>

namespace trainloop::distributed {

/// Each bucket cast to fp16, summed by the backend in fp16, cast back.
class Fp16CompressionHook : public GradientCommHook {
 public:
  /// Starts the fp16 all-reduce of bucket `index`; the sum is copied back into the bucket.
  CommFuture launch(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) override {
    torch::NoGradGuard no_grad;
    torch::Tensor& half = buffers_[index];
    if (!half.defined() || half.numel() != flat.numel()) half = torch::empty({flat.numel()}, flat.options().dtype(torch::kHalf));
    half.copy_(flat);
    return CommFuture(group.all_reduce_sum_async(half)).then([flat, half] {
      torch::NoGradGuard no_grad_here;
      flat.copy_(half);
    });
  }
  /// An all-reduce of the bucket's fp16 copy: half of fp32's bytes.
  std::int64_t bytes_sent(std::size_t /*index*/, const torch::Tensor& flat, int world_size) const override {
    return ring_all_reduce_bytes(flat.numel() * 2, world_size);
  }

 private:
  std::map<std::size_t, torch::Tensor> buffers_;  // per bucket, reused every step
};

/// Each bucket cast to bf16 and summed (see the file comment for Gloo).
class Bf16CompressionHook : public GradientCommHook {
 public:
  /// Starts the bf16 all-reduce (NCCL) or the all-gather of the bf16 bits (Gloo) of bucket
  /// `index`; the sum is written back into the bucket.
  CommFuture launch(ProcessGroup& group, std::size_t index, const torch::Tensor& flat) override {
    torch::NoGradGuard no_grad;
    world_size_ = group.world_size();
    gathers_ = group.backend() != Backend::Nccl;
    Buffers& b = buffers_[index];
    if (!b.bf16.defined() || b.bf16.numel() != flat.numel()) {
      b.bf16 = torch::empty({flat.numel()}, flat.options().dtype(torch::kBFloat16));
      if (gathers_) b.rows = torch::empty({world_size_ * flat.numel()}, flat.options().dtype(torch::kHalf));
    }
    b.bf16.copy_(flat);
    if (!gathers_) {
      return CommFuture(group.all_reduce_sum_async(b.bf16)).then([flat, bf16 = b.bf16] {
        torch::NoGradGuard no_grad_here;
        flat.copy_(bf16);
      });
    }
    // Row r is rank r's bf16 values; summed in fp32 in rank order, then rounded to bf16 like the
    // backend's own sum would be.
    return CommFuture(group.all_gather_into_async(b.bf16.view(torch::kHalf), b.rows))  // the bits, not fp16 values
        .then([flat, rows = b.rows, world = world_size_] {
          torch::NoGradGuard no_grad_here;
          const torch::Tensor values = rows.view(torch::kBFloat16).view({world, flat.numel()});
          flat.copy_(values.to(torch::kFloat32).sum(0).to(torch::kBFloat16));
        });
  }
  /// An all-reduce of the bf16 copy (NCCL) or an all-gather of it.
  std::int64_t bytes_sent(std::size_t /*index*/, const torch::Tensor& flat, int world_size) const override {
    return gathers_ ? ring_all_gather_bytes(flat.numel() * 2, world_size) : ring_all_reduce_bytes(flat.numel() * 2, world_size);
  }

 private:
  struct Buffers {
    torch::Tensor bf16;  // this rank's values
    torch::Tensor rows;  // Gloo: every rank's bf16 bits, as 16-bit halves
  };
  std::map<std::size_t, Buffers> buffers_;  // per bucket, reused every step
  int world_size_ = 1;
  bool gathers_ = false;
};

}  // namespace trainloop::distributed
