"""Training throughput of the demo model on CPU: fp32 vs bf16 autocast, and MFU.

MFU = model FLOPs per second (``flops_per_sample``: forward + backward) over the machine's
peak, measured here as the best of a few large bf16 (and fp32) matmuls on the same threads.
Targets: bf16 >= 1.8x fp32 samples/s; bf16 MFU >= 35% of the measured bf16 peak.

    PYTHONPATH=src python benchmarks/step_throughput.py [--batch 128] [--steps 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from _demo_model import demo_config, demo_model, load_average, random_inputs
from vltrain.metrics import measure_cpu_peak
from vltrain.optim import build_optimizer
from vltrain.parallelize import Dispatch
from vltrain.precision import Precision
from vltrain.step import plain_backward


def samples_per_s(precision: str, batch: int, steps: int) -> float:
    cfg = demo_config(f"train.precision={precision}")
    torch.manual_seed(0)
    model = demo_model(cfg)
    wrapped, opt = Dispatch(model), build_optimizer(model, cfg.train)
    autocast = Precision(precision, torch.device("cpu")).autocast
    inputs = random_inputs(batch, cfg)
    times = []
    for _ in range(steps + 2):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        plain_backward(wrapped, [inputs], autocast, backward=lambda loss: loss.backward())
        opt.step()
        times.append(time.perf_counter() - start)
    times = sorted(times[2:])  # two warm-up steps; the median of the rest
    return batch / times[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    flops = demo_model().flops_per_sample(demo_config().data.max_text_length)
    peak_bf16 = measure_cpu_peak(torch.bfloat16, n=2048, seconds=1.0)
    peak_fp32 = measure_cpu_peak(torch.float32, n=2048, seconds=1.0)
    rows = []
    for precision, peak in (("fp32", peak_fp32), ("bf16", peak_bf16)):
        sps = samples_per_s(precision, args.batch, args.steps)
        rows.append((precision, sps, sps * flops / 1e9, sps * flops / peak_bf16, sps * flops / peak))
    print(f"demo model, batch {args.batch}, {args.threads} threads, {flops / 1e6:.1f} MFLOP/sample (fwd+bwd)")
    print(f"measured matmul peak: bf16 {peak_bf16 / 1e9:.0f} GFLOP/s, fp32 {peak_fp32 / 1e9:.0f} GFLOP/s")
    print(load_average())
    print("| precision | samples/s | GFLOP/s | MFU vs bf16 peak | MFU vs own-dtype peak |")
    print("|---|---:|---:|---:|---:|")
    for precision, sps, gf, mfu, own in rows:
        print(f"| {precision} | {sps:.1f} | {gf:.1f} | {mfu:.1%} | {own:.1%} |")
    print(f"bf16 / fp32 = {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
