#!/usr/bin/env python3
"""mlp_pytorch: the hand-written training loop of benchmarks/bench_common.hpp in Python PyTorch, on
the MLP of compare_modes --workload mlp, so the two can be compared on the same device.

    python3 benchmarks/mlp_pytorch.py --device cuda:0 --width 4096 --layers 4 --samples 65536 \\
        --batch-size 512 --repetitions 3

Same work as compare_modes' hand and single rows: 784 -> width (x layers, ReLU) -> 10, synthetic
N(0,1) inputs and labels in [0, 10) already on the device, contiguous batches in order, SGD(lr
0.01, momentum 0.9), cross-entropy, one optimizer step per batch, the loss summed on the device,
the device synchronised after every step (as the C++ hand loop does). A short untimed warm-up
first; each repetition is one pass. Prints per repetition and
    RESULT pytorch samples_per_second <median> tflops <median>
TF32 is left at PyTorch's default (off for matmuls), as in libtorch.
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn

from pytorch_models import wide_mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6400)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--warmup-batches", type=int, default=5)
    args = parser.parse_args()

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = wide_mlp(args.width, args.layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(args.samples, 784, generator=torch.Generator().manual_seed(1)).to(device)
    y = torch.randint(0, 10, (args.samples,), generator=torch.Generator().manual_seed(2)).to(device)
    macs = 784 * args.width + (args.layers - 1) * args.width * args.width + args.width * 10
    flops_per_sample = 6.0 * macs

    def one_pass(max_batches=None):
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        batches = (args.samples + args.batch_size - 1) // args.batch_size
        if max_batches is not None:
            batches = min(batches, max_batches)
        samples = 0
        start = time.perf_counter()
        for b in range(batches):
            xb = x.narrow(0, b * args.batch_size, min(args.batch_size, args.samples - b * args.batch_size))
            yb = y.narrow(0, b * args.batch_size, xb.shape[0])
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * xb.shape[0]
            samples += xb.shape[0]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        loss_sum.item()
        return samples / (time.perf_counter() - start)

    one_pass(args.warmup_batches)
    rates = []
    for repetition in range(args.repetitions):
        rate = one_pass()
        rates.append(rate)
        print(f"repetition {repetition + 1}: {rate:.1f} samples/s, {rate * flops_per_sample / 1e12:.2f} TFLOP/s", flush=True)
    median = statistics.median(rates)
    print(f"RESULT pytorch samples_per_second {median:.1f} tflops {median * flops_per_sample / 1e12:.3f}")


if __name__ == "__main__":
    main()
