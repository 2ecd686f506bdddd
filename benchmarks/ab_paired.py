"""Training-step speed of two checkouts, step by step in turns: for a change not meant to change
speed (a redesign), measured so that a shared machine's slow spells fall on both sides alike.

``benchmarks/ab_step.py``, ``ab_train.py`` and ``ab_cpu.py`` alternate whole processes, seconds
apart; on a shared 2-core guest their rounds swing by 10-30%, more than the 3% to be resolved. Here
both sides live at once, one process per checkout (its own trainer, ``Trainer.train_step``: moving
the batch to the device, normalizing, forward, backward and AdamW), each on one thread, and take
turns a step at a time: A B B A A B ... . A side loads its next batch before it says it is ready,
and the driver starts the other side only then, so only one side runs at a time. Each pair of steps
(the same step number, hence the same batch, on both sides) gives a ratio; the table gives the
median over the pairs and its 95% bootstrap interval, wall clock and CPU time, after the first
``--skip`` pairs. Same synthetic data for both (written once by the ``--after`` checkout), the
demo's model at fp32.

    python benchmarks/ab_paired.py --before /tmp/before --after . [--pairs 150] [--batch 64]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_ops import LAYOUTS, shapes, trainer_overrides

CHILD = """
import json, os, sys, time
from vltrain.config.job import load_config
from vltrain.train.trainer import Trainer

config, overrides = sys.argv[1], sys.argv[2:]
trainer = Trainer(load_config(config, overrides))
step = trainer.train_step

def turn(micro):
    print("@ab ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        os._exit(0)
    wall, cpu = time.perf_counter(), time.process_time()
    out = step(micro)
    print("@ab " + json.dumps([time.perf_counter() - wall, time.process_time() - cpu]), flush=True)
    return out

trainer.train_step = turn
trainer.train()
"""


class Side:
    """One checkout's trainer, a step at a time."""

    def __init__(self, tree: Path, data: Path, run: Path, batch: int, steps: int, layout: str, log: Path):
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), OMP_NUM_THREADS="1")
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, str(tree / "configs" / "demo.yaml"),
             *trainer_overrides(run, data, batch, steps, layout)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, env=env, cwd=tree)

    def _read(self) -> str:
        for line in self.proc.stdout:
            if line.startswith("@ab "):
                return line[4:].strip()
        raise RuntimeError(f"the side stopped early; its output: {self.log}\n{self.log.read_text()[-2000:]}")

    def ready(self) -> None:
        assert self._read() == "ready"

    def step(self) -> tuple[float, float]:
        """Run one step and wait until the next batch is loaded: (wall s, CPU s) of the step."""
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        wall, cpu = json.loads(self._read())
        self.ready()
        return wall, cpu

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def median_interval(values: list[float], resamples: int = 2000) -> tuple[float, float]:
    """The 95% bootstrap interval of the median of ``values`` (resampled with a fixed seed)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def paired(trees: dict[str, Path], tmp: Path, data: Path, layout: str, pairs: int, skip: int, batch: int) -> str:
    name = layout.replace(" ", "-")
    sides = {s: Side(tree, data, tmp / f"{s}-{name}", batch, pairs + 2, layout, tmp / f"{s}-{name}.log")
             for s, tree in trees.items()}
    try:
        for side in sides.values():
            side.ready()
        times: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
        for i in range(pairs):
            for s in ("before", "after") if i % 2 == 0 else ("after", "before"):
                times[s].append(sides[s].step())
    finally:
        for side in sides.values():
            side.close()
    cells = [f"| {layout}"]
    for k in (0, 1):  # wall, CPU
        before = [t[k] for t in times["before"][skip:]]
        after = [t[k] for t in times["after"][skip:]]
        ratios = [b / a for a, b in zip(after, before)]  # after's speed over before's, per pair
        low, high = median_interval(ratios)
        cells += [f"{batch / statistics.median(before):.1f}", f"{batch / statistics.median(after):.1f}",
                  f"**{statistics.median(ratios):.3f}**", f"{low:.3f} to {high:.3f}"]
    return " | ".join(cells) + " |"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--pairs", type=int, default=150)
    p.add_argument("--skip", type=int, default=10)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--layouts", nargs="*", default=list(LAYOUTS))
    args = p.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = shapes(trees["after"], tmp / "shapes", args.batch * 8)
        print(f"batch {args.batch}, fp32, 1 thread per side, {args.pairs} pairs of steps in turns, the first "
              f"{args.skip} left out; load average {os.getloadavg()[0]:.1f} at the start")
        print("| layout | before samples/s | after samples/s | after / before (median of pairs) | 95% interval "
              "| before samples/CPU-s | after samples/CPU-s | after / before (median of pairs) | 95% interval |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for layout in args.layouts:
            print(paired(trees, tmp, data, layout, args.pairs, args.skip, args.batch), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
