#!/usr/bin/python3
"""checkpoint_pytorch (Python side of checkpoint_io): the time and size of torch.save of the same
state trainloop's checkpoint holds (model state_dict + Adam state_dict after one step), for the
example CNN or the ~100 MB MLP, written to a file and fsynced (trainloop fsyncs its checkpoints).

    /usr/bin/python3 benchmarks/checkpoint_pytorch.py --model cnn --repetitions 3 --dir /tmp

Prints per repetition and  RESULT pytorch model <m> parameters <n> seconds <median> bytes <size>
(seconds for torch.save + fsync; the time without fsync is printed too).
"""
import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

from pytorch_models import FashionNet, wide_mlp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["cnn", "mlp100"], default="cnn")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.model == "cnn":
        model, x = FashionNet(), torch.randn(args.batch_size, 1, 28, 28)
    else:
        model = wide_mlp(4608, 2)
        x = torch.randn(args.batch_size, 784)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    y = torch.randint(0, 10, (args.batch_size,))
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    parameters = sum(p.numel() for p in model.parameters())
    path = os.path.join(args.dir, f"checkpoint_pytorch_{args.model}.pt")
    seconds, unsynced = [], []
    for repetition in range(args.repetitions):
        start = time.perf_counter()
        with open(path, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
            f.flush()
            saved = time.perf_counter()
            os.fsync(f.fileno())
        seconds.append(time.perf_counter() - start)
        unsynced.append(saved - start)
        print(f"rep {repetition + 1}: {args.model} torch.save {unsynced[-1]:.3f} s, with fsync {seconds[-1]:.3f} s, "
              f"{os.path.getsize(path) / 1e6:.1f} MB", flush=True)
    print(f"RESULT pytorch model {args.model} parameters {parameters} seconds {statistics.median(seconds):.4f} "
          f"bytes {os.path.getsize(path)} seconds_without_fsync {statistics.median(unsynced):.4f}")
    os.remove(path)


if __name__ == "__main__":
    main()
