"""Gradient caching's memory: a global batch of 1024 via gradcache at micro-batch 64 vs one
plain step of micro-batch 64.

Each mode runs in a fresh process; peak memory is the process's peak resident set size
(``ru_maxrss``), reported whole and above the baseline measured after building the model and
optimizer. Target: the gradcache step's peak <= 1.3x the plain micro-batch step's (it holds
one micro-batch's activations plus 1024 cached embeddings, not 1024 rows of activations).

    PYTHONPATH=src python benchmarks/gradcache_memory.py [--global-batch 1024] [--micro 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch


def worker(mode: str, global_batch: int, micro: int, precision: str) -> None:
    from _demo_model import demo_config, demo_task, random_inputs

    from vltrain.runtime.precision import Precision
    from vltrain.runtime.world import keep_freed_memory
    from vltrain.train.step import gradcache_backward
    from vltrain.train.optim import build_optimizer
    from vltrain.train.step import plain_backward

    torch.set_num_threads(2)
    keep_freed_memory()  # as the trainer does on CPU
    cfg = demo_config(f"train.precision={precision}")
    torch.manual_seed(0)
    wrapped = demo_task(cfg)
    opt = build_optimizer(wrapped.model, cfg.train)
    autocast = Precision(precision, torch.device("cpu")).autocast
    n = global_batch // micro if mode == "gradcache" else 1
    batches = [random_inputs(micro, cfg, seed=i, offset=i * micro) for i in range(n)]
    baseline = psutil.Process().memory_info().rss
    step = gradcache_backward if mode == "gradcache" else plain_backward
    start = time.perf_counter()
    step(wrapped, batches, autocast, backward=lambda loss: loss.backward())
    opt.step()
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak": peak, "baseline": baseline, "seconds": elapsed, "rows": n * micro}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", default="")
    p.add_argument("--global-batch", type=int, default=1024)
    p.add_argument("--micro", type=int, default=64)
    p.add_argument("--precision", default="bf16")
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.global_batch, args.micro, args.precision)
        return
    from _demo_model import load_average

    results = {}
    for mode in ("plain", "gradcache"):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--global-batch",
               str(args.global_batch), "--micro", str(args.micro), "--precision", args.precision]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if out.returncode != 0:
            raise SystemExit(out.stderr[-3000:])
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    mb = 2**20
    print(f"demo model, {args.precision}, micro-batch {args.micro}; {load_average()}")
    print("| step | rows | peak RSS (MiB) | above baseline (MiB) | time (s) |")
    print("|---|---:|---:|---:|---:|")
    for mode, r in results.items():
        label = f"plain, micro-batch {args.micro}" if mode == "plain" else \
            f"gradcache, {args.global_batch // args.micro} x {args.micro}"
        print(f"| {label} | {r['rows']} | {r['peak'] / mb:.0f} | {(r['peak'] - r['baseline']) / mb:.0f} "
              f"| {r['seconds']:.2f} |")
    g, pl = results["gradcache"], results["plain"]
    print(f"peak ratio (whole process): {g['peak'] / pl['peak']:.2f}x; "
          f"above baseline: {(g['peak'] - g['baseline']) / max(pl['peak'] - pl['baseline'], 1):.2f}x")


if __name__ == "__main__":
    main()
