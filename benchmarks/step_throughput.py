"""Training throughput of the demo model on CPU: fp32 vs bf16 autocast, MFU, and where the time goes.

Each row is measured in a fresh process (so that allocator settings and warm caches do not leak
between rows) through the trainer's own step code: forward + backward + AdamW on random pairs.

- fp32 and bf16 rows run with the trainer's allocator setting (``keep_freed_memory``); one more
  bf16 row runs with glibc's defaults, to show what that setting is worth.
- MFU = model FLOPs per second (``flops_per_sample``: forward + backward) over the machine's
  peak, measured as the best of a few 2048 x 2048 matmuls on the same threads.
- "matmul ms" times every matmul op of a step (mm, addmm, bmm, ...) as it runs inside that step;
  "MFU ceiling" is the MFU the step would have if everything else took no time at all.

Targets: bf16 >= 1.8x fp32 samples/s; bf16 MFU >= 35% of the measured bf16 peak.

    PYTHONPATH=src python benchmarks/step_throughput.py [--batch 256] [--steps 8] [--threads 2]
        [--preset tiny-clip]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict

import torch
from _demo_model import demo_config, demo_task, load_average, random_inputs
from torch.utils._python_dispatch import TorchDispatchMode

from vltrain.runtime.precision import Precision
from vltrain.runtime.world import keep_freed_memory
from vltrain.train.metrics import measure_cpu_peak
from vltrain.train.optim import build_optimizer
from vltrain.train.step import plain_backward

# the matmul ops as they reach the dispatcher (linear and matmul decompose into these first)
MATMULS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "convolution"}


class OpTimer(TorchDispatchMode):
    """Wall time per aten op name, as the ops run (the mode itself adds a few microseconds each)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = defaultdict(float)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.seconds[func.overloadpacket.__name__] += time.perf_counter() - start
        return out


def measure(precision: str, allocator: str, batch: int, steps: int, threads: int, preset: str) -> dict:
    torch.set_num_threads(threads)
    if allocator == "trainer":
        keep_freed_memory()
    cfg = demo_config(f"train.precision={precision}", *([f"model.preset={preset}"] if preset else []))
    torch.manual_seed(0)
    wrapped = demo_task(cfg)
    opt = build_optimizer(wrapped.model, cfg.train)
    autocast = Precision(precision, torch.device("cpu")).autocast
    inputs = random_inputs(batch, cfg)

    def step() -> float:
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        plain_backward(wrapped, [inputs], autocast, backward=lambda loss: loss.backward())
        opt.step()
        return time.perf_counter() - start

    for _ in range(2):  # warm-up
        step()
    times = sorted(step() for _ in range(steps))
    timer = OpTimer()
    with timer:
        for _ in range(3):
            step()
    matmul = sum(s for name, s in timer.seconds.items() if name in MATMULS) / 3
    return {"step_s": times[len(times) // 2], "matmul_s": matmul,
            "flops": wrapped.model.flops_per_sample(cfg.data.max_text_length), "preset": cfg.model.preset}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--preset", default="", help="a model preset instead of the demo config's")
    p.add_argument("--child", nargs=2, metavar=("PRECISION", "ALLOCATOR"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child, args.batch, args.steps, args.threads, args.preset)))
        return
    torch.set_num_threads(args.threads)
    peak = {"bf16": measure_cpu_peak(torch.bfloat16, n=2048, seconds=1.0),
            "fp32": measure_cpu_peak(torch.float32, n=2048, seconds=1.0)}
    rows = []
    for precision, allocator in (("fp32", "trainer"), ("bf16", "trainer"), ("bf16", "glibc")):
        out = subprocess.run(
            [sys.executable, __file__, "--child", precision, allocator, "--batch", str(args.batch),
             "--steps", str(args.steps), "--threads", str(args.threads), "--preset", args.preset],
            check=True, capture_output=True, text=True,
        )
        rows.append((precision, allocator, json.loads(out.stdout.strip().splitlines()[-1])))
    r = rows[0][2]
    print(f"{'demo model' if not args.preset else 'model'} ({r['preset']}), batch {args.batch}, {args.threads} threads, "
          f"{r['flops'] / 1e6:.1f} MFLOP/sample (fwd+bwd), median of {args.steps} steps")
    print(f"measured matmul peak: bf16 {peak['bf16'] / 1e9:.0f} GFLOP/s, fp32 {peak['fp32'] / 1e9:.0f} GFLOP/s")
    print(load_average())
    print("| precision | allocator | samples/s | step ms | matmul ms | GFLOP/s | MFU vs bf16 peak "
          "| MFU vs own-dtype peak | ceiling: matmuls only, vs own-dtype peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for precision, allocator, m in rows:
        sps = args.batch / m["step_s"]
        flops = sps * m["flops"]
        ceiling = args.batch * m["flops"] / m["matmul_s"] / peak[precision]
        print(f"| {precision} | {allocator} | {sps:.0f} | {m['step_s'] * 1e3:.0f} | {m['matmul_s'] * 1e3:.0f} "
              f"| {flops / 1e9:.0f} | {flops / peak['bf16']:.1%} | {flops / peak[precision]:.1%} | {ceiling:.1%} |")
    print(f"bf16 / fp32 = {rows[0][2]['step_s'] / rows[1][2]['step_s']:.2f}x (trainer allocator); "
          f"bf16 trainer / glibc allocator = {rows[2][2]['step_s'] / rows[1][2]['step_s']:.2f}x")


if __name__ == "__main__":
    main()
