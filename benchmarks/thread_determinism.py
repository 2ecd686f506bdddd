"""What a bit-identical step costs on a CPU: the deterministic gathers against the racing ones, and
the step at every core against the step forced onto one thread.

The step's only thread-dependent sums were two gathers whose backward accumulates into shared rows:
ITM's hard negatives (``tokens[negatives]``) and packed text's positions (``pos_embed[positions]``).
Indexing with a tensor has a backward that adds with atomics from every thread, in whatever order
they arrive; ``index_select``'s backward adds in a fixed order. Rows:

- the two gathers' forward + backward at the demo step's shapes, each way (side by side);
- the demo model's whole step (forward, backward, AdamW) at ``--threads`` and at one thread: what
  forcing one thread, the other way to be deterministic, would cost.

    PYTHONPATH=src python benchmarks/thread_determinism.py [--batch 64] [--threads 2] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time

import torch
from _demo_model import demo_config, demo_task, load_average, random_inputs

from vltrain.runtime.precision import Precision
from vltrain.train.optim import build_optimizer
from vltrain.train.step import plain_backward


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gather_times(rows: int, length: int, width: int, repeats: int) -> tuple[float, float, bool]:
    """(racing, fixed-order) seconds of a gather of ``rows`` rows with repeats, forward + backward,
    and whether two racing backwards differed."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, length, width, generator=g, requires_grad=True)
    index = torch.randint(0, rows, (rows,), generator=g)
    grad = torch.randn(rows, length, width, generator=g)

    def racing():
        x.grad = None
        x[index].backward(grad)
        return x.grad.clone()

    def fixed():
        x.grad = None
        x.index_select(0, index).backward(grad)
        return x.grad.clone()

    differed = any(not torch.equal(racing(), racing()) for _ in range(5))
    return median_time(racing, repeats), median_time(fixed, repeats), differed


def step_times(batch: int, threads: int, repeats: int) -> tuple[float, float]:
    """Median step seconds at ``threads`` and at one thread, the two measured in turn so that a busy
    machine slows both alike."""
    cfg = demo_config("train.precision=fp32")
    torch.manual_seed(0)
    task = demo_task(cfg)
    opt = build_optimizer(task.model, cfg.train)
    autocast = Precision("fp32", torch.device("cpu")).autocast
    inputs = random_inputs(batch, cfg)

    def step(n: int) -> float:
        torch.set_num_threads(n)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        plain_backward(task, [inputs], autocast, backward=lambda loss: loss.backward())
        opt.step()
        return time.perf_counter() - start

    step(threads), step(1)
    many, one = zip(*((step(threads), step(1)) for _ in range(repeats)))
    return sorted(many)[repeats // 2], sorted(one)[repeats // 2]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    cfg = demo_config()
    task = demo_task(cfg)
    vision, text = task.model.vision, task.model.text
    tokens = vision.num_prefix + (cfg.data.image_size // vision.cfg.patch_size) ** 2
    torch.set_num_threads(args.threads)
    shapes = {"ITM image negatives": (args.batch, tokens, vision.cfg.width),
              "ITM text negatives": (args.batch, cfg.data.max_text_length, text.cfg.width)}
    print(f"demo model ({cfg.model.preset}), batch {args.batch}, {args.threads} threads; {load_average()}")
    print("| gather (fwd + bwd) | shape | racing ms | fixed order ms | fixed / racing | racing ever differed |")
    print("|---|---|---:|---:|---:|---|")
    for name, (rows, length, width) in shapes.items():
        racing, fixed, differed = gather_times(rows, length, width, args.repeats)
        print(f"| {name} | {rows} x {length} x {width} | {racing * 1e3:.3f} | {fixed * 1e3:.3f} "
              f"| {fixed / racing:.2f}x | {'yes' if differed else 'no'} |")
    many, one = step_times(args.batch, args.threads, max(3, args.repeats // 2))
    print("\n| whole step (fp32, fwd + bwd + AdamW) | step ms | samples/s |")
    print("|---|---:|---:|")
    print(f"| {args.threads} threads, deterministic gathers | {many * 1e3:.0f} | {args.batch / many:.0f} |")
    print(f"| 1 thread (forced) | {one * 1e3:.0f} | {args.batch / one:.0f} |")
    print(f"forcing one thread would cost {one / many:.2f}x the step time")


if __name__ == "__main__":
    main()
