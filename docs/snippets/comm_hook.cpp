// A gradient comm hook of your own, in two rounds: the ranks first agree on a scale (the largest
// squared gradient norm of the bucket over the ranks), then send the bucket as fp16 divided by it,
// so no large gradient overflows fp16's range. The first round's collective is started by
// launch(); the second, which needs its result, is a `.then` round; writing the mean back is a
// finishing step. The reducer runs launch() and the rounds on its communication thread, in the
// same bucket order on every rank, while backward goes on.
#include <trainloop/trainloop.hpp>

#include <cmath>
#include <iostream>

namespace tl = trainloop;
namespace dist = trainloop::distributed;

class ScaledHalfHook : public dist::GradientCommHook {
 public:
  dist::CommFuture launch(dist::ProcessGroup& group, std::size_t /*index*/, const torch::Tensor& flat) override {
    torch::NoGradGuard no_grad;
    // Round 1: every rank's squared norm, summed (a bound for each rank's largest value).
    torch::Tensor norm2 = flat.square().sum().reshape({1}).to(torch::kFloat32);
    return dist::CommFuture(group.all_reduce_sum_async(norm2))
        .then([&group, flat, norm2] {  // round 2: once the sum arrived, the scaled fp16 bucket
          torch::NoGradGuard no_grad_here;
          const double scale = std::max(std::sqrt(norm2.item<double>()), 1e-30);
          torch::Tensor half = (flat / scale).to(torch::kHalf);
          return dist::CommFuture(group.all_reduce_sum_async(half)).then([flat, half, scale] {
            torch::NoGradGuard no_grad_finish;  // finishing step: the mean back into the bucket
            flat.copy_(half.to(flat.scalar_type()) * scale);
          });
        });
  }
  // What a bucket's rounds put on the wire, in the ring model (the reducer sums it per step).
  std::int64_t bytes_sent(std::size_t /*index*/, const torch::Tensor& flat, int world_size) const override {
    return dist::ring_all_reduce_bytes(4, world_size) + dist::ring_all_reduce_bytes(flat.numel() * 2, world_size);
  }
};

int main() {
  using DDP = tl::gpu_mode::DistributedDataParallel;
  torch::manual_seed(0);
  const torch::Tensor x = torch::randn({256, 8});
  const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  tl::data::TensorDataset train(x, y);
  torch::nn::Sequential net(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 2));
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  tl::TrainLoop<torch::nn::Sequential, DDP> loop(
      net, train, {}, optimizer, torch::nn::CrossEntropyLoss(), tl::TrainLoopOptions().batch_size(32),
      DDP().procs_per_node(2).device_type(torch::kCPU).comm_hook([] { return std::make_shared<ScaledHalfHook>(); }));
  const tl::History history = loop.fit(2);
  if (tl::is_main_process()) std::cout << "train loss " << history.last().train_loss << '\n';
  return 0;
}
