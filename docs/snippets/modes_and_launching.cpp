// DistributedDataParallel fixed at compile time. As a plain program it starts its 2 ranks itself;
// under a launcher the ranks join instead, with no change to the program:
//   torchrun --nproc-per-node 2 --no-python ./app     srun ./app     mpirun -np 2 ./app
#include <trainloop/trainloop.hpp>

#include <iostream>

int main() {
  namespace tl = trainloop;
  using DDP = tl::gpu_mode::DistributedDataParallel;
  // Code before fit() runs in every rank too: build the same data and model in each.
  const auto [train, valid] = tl::rank0_first([] {  // rank 0 first: downloads, unpacking, caches
    torch::manual_seed(0);
    const torch::Tensor x = torch::randn({512, 8});
    const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
    return std::pair(tl::data::TensorDataset(x.narrow(0, 0, 384), y.narrow(0, 0, 384)),
                     tl::data::TensorDataset(x.narrow(0, 384, 128), y.narrow(0, 384, 128)));
  });
  torch::manual_seed(1);
  torch::nn::Sequential net(torch::nn::Linear(8, 64), torch::nn::ReLU(), torch::nn::Linear(64, 2));
  torch::optim::Adam optimizer(net->parameters(), torch::optim::AdamOptions(1e-2));

  tl::TrainLoop loop(  // TrainLoop<torch::nn::Sequential, DDP>: the mode's type is the loop's
      net, train, valid, optimizer, torch::nn::CrossEntropyLoss(),
      tl::TrainLoopOptions().batch_size(32).metrics({tl::Accuracy()}),  // batch per rank
      DDP()
          .procs_per_node(2)                                      // ranks this program starts (spawn mode)
          .device_type(torch::kCPU)                               // Gloo; CUDA ranks use NCCL
          .zero(true)                                             // ZeRO-1: Adam's state sharded over the ranks
          .comm_hook(tl::distributed::comm_hook_named("fp16")));  // gradients travel in 16 bits
  const tl::History history = loop.fit(3);

  // Spawn mode: this runs once, in your process, with the trained weights in `net`. Under a
  // launcher it runs on every rank: print on one.
  if (tl::is_main_process()) {
    std::cout << "validation accuracy " << history.validation("accuracy") << '\n';
  }
  return 0;
}
