"""Data-parallel scaling on one CPU: 1 process x 2 threads vs torchrun 2 processes x 1 thread.

Both train the demo model on the same global batch (random pairs, no data loading), through the
trainer's own wrapping (DDP over gloo) and step code. Target: the 2-process run reaches >= 0.9x
the samples/s of the 1-process run, i.e. gradient all-reduce and the distributed contrastive
loss cost little next to the compute they parallelize. The default global batch, 512, is what
``torchrun --nproc-per-node 2 -m vltrain train configs/demo.yaml`` runs (256 rows per rank).

    PYTHONPATH=src python benchmarks/ddp_scaling.py [--global-batch 512] [--steps 8] [--precision bf16]
        [--preset tiny-clip]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from _net import free_port


def worker(args: argparse.Namespace) -> None:
    from _demo_model import demo_config, demo_task, random_inputs

    from vltrain.runtime.precision import Precision
    from vltrain.runtime.world import setup_world
    from vltrain.train.optim import build_optimizer
    from vltrain.train.parallelize import parallelize
    from vltrain.train.step import plain_backward

    cfg = demo_config(f"train.precision={args.precision}", *([f"model.preset={args.preset}"] if args.preset else []))
    world = setup_world(threads=args.threads, device="cpu")
    torch.manual_seed(0)
    task = demo_task(cfg)
    wrapped = parallelize(task, cfg.train, world.device)
    opt = build_optimizer(task.model, cfg.train)
    autocast = Precision(args.precision, world.device).autocast
    local = args.global_batch // world.world_size
    inputs = random_inputs(local, cfg, seed=world.rank, offset=world.rank * local)
    times = []
    for _ in range(args.steps + 2):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        plain_backward(wrapped, [inputs], autocast, backward=lambda loss: loss.backward())
        opt.step()
        times.append(time.perf_counter() - start)
    times = sorted(times[2:])
    if world.is_main:
        print(json.dumps({"samples_per_s": args.global_batch / times[len(times) // 2]}))
    world.close()


def launch(nproc: int, threads: int, args: argparse.Namespace) -> float:
    script = [str(Path(__file__).resolve()), "--worker", "--threads", str(threads),
              "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--precision", args.precision, "--preset", args.preset]
    if nproc == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *script]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1200)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--preset", default="", help="a model preset instead of the demo config's")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    from _demo_model import load_average

    one = launch(1, 2, args)
    two = launch(2, 1, args)
    print(f"{args.preset or 'demo'} model, global batch {args.global_batch}, {args.precision}; {load_average()}")
    print("| layout | samples/s | vs 1 process |")
    print("|---|---:|---:|")
    print(f"| 1 process x 2 threads | {one:.1f} | 1.00x |")
    print(f"| torchrun 2 processes x 1 thread (DDP, gloo) | {two:.1f} | {two / one:.2f}x |")


if __name__ == "__main__":
    main()
