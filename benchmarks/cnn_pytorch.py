#!/usr/bin/python3
"""cnn_pytorch: the Fashion-MNIST CNN trained by Python PyTorch, single process or DDP (Gloo, CPU
ranks), doing the work of compare_modes --workload cnn's "single" and "ddp" rows, for
benchmarks/run_cnn_vs_pytorch.sh to alternate with them.

    /usr/bin/python3 benchmarks/cnn_pytorch.py --mode single --samples 6400 --batch-size 64
    /usr/bin/python3 benchmarks/cnn_pytorch.py --mode ddp --ranks 2 --samples 6400 --batch-size 64

Same work: FashionNet (pytorch_models.py), a fixed random subset of the real training split
(Debian's dataset-fashion-mnist) held in memory in that random order, contiguous batches of
--batch-size (per rank under DDP, rank r taking positions r, r+ranks, ... as trainloop's
sampler does), Adam(lr 1e-3), cross-entropy, the loss summed on the device and read once per
pass. One warm-up pass, then one timed pass; prints
    RESULT pytorch mode <m> samples_per_second <v> threads <intra-op> gflops <v>
Thread settings are whatever the environment says (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS):
run it "at its defaults" and "tuned" by setting them.
"""
import argparse
import gzip
import os
import socket
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from pytorch_models import FASHION_NET_FORWARD_MACS, FashionNet

DATA = os.environ.get("TRAINLOOP_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist")


def load_subset(samples, seed=0):
    with gzip.open(os.path.join(DATA, "train-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(DATA, "train-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    x = (x - x.mean()) / x.std()
    pick = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:samples]
    return x[pick].contiguous(), torch.from_numpy(labels.astype(np.int64))[pick].contiguous()


def one_pass(model, optimizer, x, y, batch_size, bf16=False):
    loss_sum = torch.zeros((), dtype=torch.float64)
    start = time.perf_counter()
    for first in range(0, len(y), batch_size):
        xb, yb = x[first:first + batch_size], y[first:first + batch_size]
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach() * len(yb)
    loss_sum.item()
    return time.perf_counter() - start


def worker(rank, args, port, results):
    if args.mode == "ddp":
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
        dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    x, y = load_subset(args.samples)
    ranks = args.ranks if args.mode == "ddp" else 1
    x, y = x[rank::ranks].contiguous(), y[rank::ranks].contiguous()
    torch.manual_seed(0)
    model = FashionNet()
    if args.memory_format == "channels-last":
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    bf16 = args.precision == "bf16"
    if args.mode == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    one_pass(model, optimizer, x[:args.batch_size * 5], y[:args.batch_size * 5], args.batch_size, bf16)  # warm-up
    if args.mode == "ddp":
        dist.barrier()
    seconds = one_pass(model, optimizer, x, y, args.batch_size, bf16)
    if args.mode == "ddp":
        dist.barrier()
    if rank == 0:
        results.put((args.samples / seconds, torch.get_num_threads()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mode", choices=["single", "ddp"], default="single")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: torch.autocast('cpu', torch.bfloat16) around forward and loss")
    parser.add_argument("--memory-format", choices=["contiguous", "channels-last"], default="contiguous",
                        help="channels-last: the model and the whole input tensor in torch.channels_last")
    args = parser.parse_args()
    if args.mode == "single":
        import queue
        results = queue.Queue()
        worker(0, args, 0, results)
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        context = mp.get_context("spawn")
        results = context.SimpleQueue()
        mp.spawn(worker, args=(args, port, results), nprocs=args.ranks, join=True)
    rate, threads = results.get()
    gflops = rate * 6 * FASHION_NET_FORWARD_MACS / 1e9
    print(f"RESULT pytorch mode {args.mode} precision {args.precision} memory_format {args.memory_format} samples_per_second {rate:.1f} threads {threads} gflops {gflops:.2f}", flush=True)


if __name__ == "__main__":
    main()
