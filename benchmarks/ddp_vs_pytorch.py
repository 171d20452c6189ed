#!/usr/bin/python3
"""ddp_vs_pytorch (PyTorch side): throughput of PyTorch's Python DistributedDataParallel on CPU
ranks (Gloo), doing exactly the work of benchmarks/ddp_vs_pytorch.cpp; both are alternated by
benchmarks/run_ddp_vs_pytorch.sh, which reports the median ratio trainloop/pytorch.

    /usr/bin/python3 benchmarks/ddp_vs_pytorch.py --ranks 2 --batch-size 64 --steps 150 --epochs 2

Same work as the C++ side: MLP 784 -> 1024 -> 1024 -> 10 (ReLU), synthetic N(0,1) data of
ranks * batch * steps samples, rank r trains its contiguous shard in order with per-rank batch
`--batch-size`, SGD(lr 0.01, momentum 0.9), cross-entropy, torch.set_num_threads(1) per rank,
DDP's default buckets (25 MiB, first ~1 MiB, as trainloop's defaults). Like trainloop's History,
each epoch is timed from the first batch to the last optimizer step with the loss read back
once per step (trainloop accumulates the loss per batch too), excluding process start,
rendezvous, model broadcast and data creation; samples/s counts the samples of all ranks.
Epoch 1 is a warm-up; the last epoch is reported as
    RESULT pytorch samples_per_second <value>
Use Debian's python3-torch (/usr/bin/python3), the same libtorch 1.13 as the C++ side.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def wide_mlp():
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def worker(rank, args, port, results):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.manual_seed(0)
    samples = args.ranks * args.batch_size * args.steps
    x = torch.randn(samples, 784, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (samples,), generator=torch.Generator().manual_seed(2))
    shard = samples // args.ranks
    x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    model = nn.parallel.DistributedDataParallel(wide_mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        dist.barrier()
        start = time.perf_counter()
        loss_sum = 0.0
        for step in range(args.steps):
            xb = x[step * args.batch_size:(step + 1) * args.batch_size]
            yb = y[step * args.batch_size:(step + 1) * args.batch_size]
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * xb.shape[0]
        seconds = time.perf_counter() - start
        # The epoch ends when the slowest rank ends (as in trainloop, whose ranks meet in collectives).
        t = torch.tensor([seconds, loss_sum], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put((epoch, t[0].item(), samples, loss_sum / shard))
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args, free_port(), results), nprocs=args.ranks, start_method="spawn")
    last = None
    while not results.empty():
        epoch, seconds, samples, loss = results.get()
        last = samples / seconds
        print(f"pytorch epoch {epoch}: steps {args.steps} samples {samples} seconds {seconds:.4f} "
              f"samples/s {last:.1f} loss {loss:.4f}")
    print(f"RESULT pytorch samples_per_second {last:.3f}")


if __name__ == "__main__":
    main()
