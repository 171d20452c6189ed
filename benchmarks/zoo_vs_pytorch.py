#!/usr/bin/python3
"""zoo_vs_pytorch (PyTorch side): training throughput of torchvision's resnet18/resnet50 in one
process or in DistributedDataParallel on CPU ranks (Gloo), doing exactly the work of
benchmarks/zoo_vs_pytorch.cpp; benchmarks/run_zoo_vs_pytorch.sh alternates both.

    /usr/bin/python3 benchmarks/zoo_vs_pytorch.py --arch resnet18 --size 64 --batch-size 32 --steps 20 --mode single
    python benchmarks/zoo_vs_pytorch.py --timm resnet18 ...   # timm's model, eager (the peer of --exported)
    python benchmarks/zoo_vs_pytorch.py --compile ...         # the model through torch.compile (epoch 1 compiles)

Same work: synthetic N(0,1) images 3 x size x size, 10 classes, world * batch * steps samples,
each rank its contiguous shard in order, SGD(lr 0.01, momentum 0.9), cross-entropy; single: 2
threads, ddp: 1 thread per rank. Each epoch is timed from its first batch to its last optimizer
step with the loss read back once per step (as trainloop's History); epoch 1 is a warm-up and the
last is reported as
    RESULT pytorch samples_per_second <value>
Use Debian's python3-torch (/usr/bin/python3): the same libtorch 1.13 as the C++ side.
"""
import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torchvision


def train(rank, world, args, results):
    samples = world * args.batch_size * args.steps
    x = torch.randn(samples, 3, args.size, args.size, generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 10, (samples,), generator=torch.Generator().manual_seed(2))
    shard = samples // world
    x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
    torch.manual_seed(0)
    if args.timm:
        import timm
        extra = dict(img_size=args.size) if 'vit' in args.timm else {}
        model = timm.create_model(args.timm, num_classes=10, **extra)
    else:
        model = getattr(torchvision.models, args.arch)(num_classes=10)
    device = torch.device(args.device)
    model = model.to(device)
    if args.memory_format == "channels-last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    if args.compile:
        model = torch.compile(model)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(1, args.epochs + 1):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        loss_sum = 0.0
        for step in range(args.steps):
            xb = x[step * args.batch_size:(step + 1) * args.batch_size]
            yb = y[step * args.batch_size:(step + 1) * args.batch_size]
            xb, yb = xb.to(device), yb.to(device)
            optimizer.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = loss_fn(model(xb), yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * xb.shape[0]
        seconds = time.perf_counter() - start
        t = torch.tensor([seconds, loss_sum], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if rank == 0:
            results.put((epoch, t[0].item(), samples, loss_sum / shard))


def worker(rank, args, port, results):
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    train(rank, args.ranks, args, results)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ListQueue(list):
    put = list.append


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--timm", default="", help="train this timm model (eager) instead of torchvision's --arch")
    parser.add_argument("--size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--mode", default="single", choices=["single", "ddp"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda:0 (single)")
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                        help="bf16: torch.autocast('cpu', torch.bfloat16) around forward and loss")
    parser.add_argument("--memory-format", default="contiguous", choices=["contiguous", "channels-last"],
                        help="channels-last: the model and the input tensor in torch.channels_last")
    parser.add_argument("--compile", action="store_true", help="torch.compile(model): inductor's kernels")
    args = parser.parse_args()
    if args.mode == "single":
        torch.set_num_threads(2)
        results = ListQueue()
        train(0, 1, args, results)
        collected = list(results)
    else:
        ctx = mp.get_context("spawn")
        queue = ctx.SimpleQueue()
        mp.start_processes(worker, args=(args, free_port(), queue), nprocs=args.ranks, start_method="spawn")
        collected = []
        while not queue.empty():
            collected.append(queue.get())
    last = None
    for epoch, seconds, samples, loss in collected:
        last = samples / seconds
        print(f"pytorch epoch {epoch}: steps {args.steps} samples {samples} seconds {seconds:.3f} "
              f"samples/s {last:.2f} loss {loss:.4f}")
    print(f"RESULT pytorch samples_per_second {last:.3f}")


if __name__ == "__main__":
    main()
