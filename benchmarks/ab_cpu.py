"""The CPU time of a training step of two checkouts, side by side in one run, for each image layout:
for a change not meant to change speed (a redesign), measured in a way a shared machine disturbs
less than wall-clock rates (``benchmarks/ab_train.py``): the process's CPU time, one thread.

Each measurement is one fresh process of the checkout's own trainer (``Trainer.train_step``: moving
the batch to the device, normalizing, forward, backward and AdamW; the loader's work is outside it)
on the same synthetic data (written once by the ``--after`` checkout), the demo's model at fp32,
``train.threads=1``; its figure is the median ``time.process_time()`` of the steps after the first
``--skip``. A CPU second is counted only while the process runs, so time the machine gives to other
work (other processes, another guest) is not counted; caches and memory bandwidth shared with them
still are. The two sides alternate within each round (A B, then B A); the table gives each side's
median over the rounds and the median and range of the per-round ratios.

    python benchmarks/ab_cpu.py --before /tmp/before --after . [--rounds 5] [--steps 30] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_ops import LAYOUTS, shapes, trainer_overrides
from ab_step import side_by_side

CHILD = """
import json, statistics, sys, time
from vltrain.config.job import load_config
from vltrain.train.trainer import Trainer

config, skip, overrides = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
trainer = Trainer(load_config(config, overrides))
step, times = trainer.train_step, []

def timed(micro):
    start = time.process_time()
    out = step(micro)
    times.append(time.process_time() - start)
    return out

trainer.train_step = timed
trainer.train()
trainer.close()
print(json.dumps(statistics.median(times[skip:])))
"""


def cpu_seconds(tree: Path, data: Path, run: Path, batch: int, steps: int, skip: int, layout: str) -> float:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree / "configs" / "demo.yaml"), str(skip),
                          *trainer_overrides(run, data, batch, steps, layout)],
                         check=True, capture_output=True, text=True, env=env, cwd=tree)
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = p.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        data = shapes(sides["after"], Path(tmp) / "shapes", args.batch * 8)
        print(f"batch {args.batch}, 1 thread, median CPU time of steps {args.skip + 1}-{args.steps} per process, "
              f"{args.rounds} rounds; load average {os.getloadavg()[0]:.1f} at the start")
        print("| layout | before samples/CPU-s | after samples/CPU-s | after / before (median of rounds) | range |")
        print("|---|---:|---:|---:|---:|")
        for layout in args.layouts:
            def measure(side: str, r: int, layout: str = layout) -> float:
                run = Path(tmp) / f"{side}-{layout.replace(' ', '-')}-{r}"
                return args.batch / cpu_seconds(sides[side], data, run, args.batch, args.steps, args.skip, layout)
            print(side_by_side(layout, args.rounds, measure), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
