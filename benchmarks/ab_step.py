"""Square-image step throughput of two checkouts, side by side in one run: before and after a change
that is not meant to change speed.

Each measurement is one fresh process of the checkout's own ``benchmarks/step_throughput.py``
(``--child``: the demo model's forward + backward + AdamW on random pairs, median of ``--steps``
steps, the trainer's allocator setting), with that checkout's ``src`` first on the path. The two
sides alternate within each round (A B, then B A), so that a slow spell of a shared machine falls
on both; the table gives each side's median over the rounds and the median of the per-round ratios.

    python benchmarks/ab_step.py --before /tmp/before --after . [--rounds 5] [--batch 128] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path


def child(tree: Path, precision: str, batch: int, steps: int, threads: int) -> float:
    """Samples/s of one fresh process of ``tree``'s step benchmark."""
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run(
        [sys.executable, str(tree / "benchmarks" / "step_throughput.py"), "--child", precision, "trainer",
         "--batch", str(batch), "--steps", str(steps), "--threads", str(threads)],
        check=True, capture_output=True, text=True, env=env, cwd=tree,
    )
    return batch / json.loads(out.stdout.strip().splitlines()[-1])["step_s"]


def side_by_side(label: str, rounds: int, measure: Callable[[str, int], float]) -> str:
    """The table row of ``label``: ``measure(side, round)`` of "before" and "after", alternating within
    each round (A B, then B A) so that a slow spell of a shared machine falls on both; each side's
    median and the median and range of the per-round ratios."""
    rates: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(rounds):
        for side in ("before", "after") if r % 2 == 0 else ("after", "before"):
            rates[side].append(measure(side, r))
    ratios = [a / b for a, b in zip(rates["after"], rates["before"])]
    return (f"| {label} | {statistics.median(rates['before']):.0f} | {statistics.median(rates['after']):.0f} "
            f"| {statistics.median(ratios):.3f} | {min(ratios):.3f} to {max(ratios):.3f} |")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"batch {args.batch}, {args.threads} threads, median of {args.steps} steps per process, "
          f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} at the start")
    print("| precision | before samples/s | after samples/s | after / before (median of rounds) | range |")
    print("|---|---:|---:|---:|---:|")
    for precision in ("fp32", "bf16"):
        print(side_by_side(precision, args.rounds,
                           lambda side, r: child(sides[side], precision, args.batch, args.steps, args.threads)),
              flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
