"""Python's side of benchmarks/checkpoint_stall.cpp: how long dcp.save and dcp.async_save block
the calling (training) thread for the same state on the same machine — the ~100 M-parameter MLP's
(6 x 4096 + head, Adam after one step) parameters and optimizer state sharded over 2 CPU ranks as
FSDP2 holds them (DTensors, Shard(0)), saved into a fresh directory each time. Interleaved,
--repetitions times; prints one line per method:

    python_dcp method=save|async_save ranks=2 blocking_ms=<median> blocking_min_ms= blocking_max_ms= written_s=<median>

(blocking: the call on rank 0; written: until the checkpoint is complete, async_save's future done).
No training runs in between: async_save's writer thread has the machine to itself here, whereas
trainloop's shares it with the training ranks (run_checkpoint_stall.sh says so beside the numbers).

    python benchmarks/checkpoint_stall.py --dir /tmp/x --repetitions 3 [--layers 6 --width 4096]
"""
import argparse
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp


def build_state(args, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.ReLU())], torch.nn.Linear(args.width, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(8, args.width)
    torch.nn.functional.cross_entropy(model(x), torch.zeros(8, dtype=torch.long)).backward()
    optimizer.step()
    mesh = init_device_mesh("cpu", (world,))
    model_state, optim_state = {}, {}
    for name, parameter in model.named_parameters():
        model_state[name] = distribute_tensor(parameter.detach(), mesh, [Shard(0)])
        fields = optimizer.state[parameter]
        optim_state[name] = {
            "exp_avg": distribute_tensor(fields["exp_avg"], mesh, [Shard(0)]),
            "exp_avg_sq": distribute_tensor(fields["exp_avg_sq"], mesh, [Shard(0)]),
            "step": fields["step"].clone(),
        }
    return {"model": model_state, "optim": {"state": optim_state}}


def worker(rank, world, args, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build_state(args, rank, world)
    results = {"save": [], "async_save": []}
    for repetition in range(args.repetitions):
        for method in ("save", "async_save"):
            target = os.path.join(args.dir, f"{method}-{repetition}")
            dist.barrier()
            start = time.perf_counter()
            if method == "save":
                dcp.save(state, checkpoint_id=target)
                blocked = time.perf_counter() - start
            else:
                pending = dcp.async_save(state, checkpoint_id=target)
                blocked = time.perf_counter() - start
                future = getattr(pending, "upload_completion", pending)  # 2.15: an AsyncSaveResponse or a Future
                future.result()
            written = time.perf_counter() - start
            dist.barrier()
            results[method].append((blocked, written))
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", default="/tmp/trainloop_checkpoint_stall_python")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    mp.start_processes(worker, args=(args.ranks, args, port, queue), nprocs=args.ranks, start_method="spawn")
    results = queue.get()
    for method, runs in results.items():
        blocked = [b * 1e3 for b, _ in runs]
        written = [w for _, w in runs]
        print(f"python_dcp method={method} torch={torch.__version__} ranks={args.ranks} blocking_ms={statistics.median(blocked):.1f} "
              f"blocking_min_ms={min(blocked):.1f} blocking_max_ms={max(blocked):.1f} written_s={statistics.median(written):.3f}")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
