"""Training speed of two checkouts through ``vltrain train``, side by side in one run, for each image
layout: square images, native shape (padded), native shape packed. For a change that is not meant
to change speed (a redesign): the whole path runs, the collator, the model's layout code and the step.

Each measurement is one fresh ``python -m vltrain train`` of the checkout's own ``src`` on the same
synthetic data (written once by the ``--after`` checkout), ``--steps`` steps of the demo's model
(tiny-coca-lite) at fp32, logged every step; its rate is the median ``samples_per_s`` of the steps
after the first ``--skip``. The two sides alternate within each round (A B, then B A), so that a slow
spell of a shared machine falls on both; the table gives each side's median over the rounds and the
median of the per-round ratios.

    python benchmarks/ab_train.py --before /tmp/before --after . [--rounds 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_step import side_by_side

LAYOUTS = {
    "square": [],
    "native": ["data.resize=native", "data.max_patches=16"],
    "native packed": ["data.resize=native", "data.max_patches=16", "data.pack_images=true"],
}
"""The overrides of each layout, on top of the demo config (48 px images, 16 px patches: 9 patches)."""


def vltrain(tree: Path, *argv: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    subprocess.run([sys.executable, "-m", "vltrain", *argv], check=True, capture_output=True, text=True,
                   env=env, cwd=tree)


def rate(tree: Path, data: Path, run: Path, layout: str, args) -> float:
    """Median samples/s of one run of ``tree``."""
    vltrain(tree, "train", str(tree / "configs" / "demo.yaml"), f"run.dir={run}",
            f"data.train={data / 'train.jsonl'}", "data.val=''", f"data.tokenizer={data / 'tokenizer.json'}",
            f"data.batch_size={args.batch}", "data.num_workers=1", f"train.max_steps={args.steps}",
            "train.precision=fp32", "train.log_every=1", "train.progress=false", f"train.threads={args.threads}",
            "eval.every=0", "checkpoint.every=0", "metrics.curves=false", *LAYOUTS[layout])
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rates = [r["samples_per_s"] for r in rows if "samples_per_s" in r and r.get("step", 0) > args.skip]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (warm-up)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shapes"
        vltrain(sides["after"], "data", "synth", "--out", str(data), "--num", str(args.batch * args.steps),
                "--val", "0", "--workers", "1")
        vltrain(sides["after"], "tokenizer", "train", str(data / "train.jsonl"), "--out",
                str(data / "tokenizer.json"), "--vocab-size", "512")
        print(f"tiny-coca-lite fp32, batch {args.batch}, {args.threads} train thread(s) + 1 loader worker, "
              f"median of steps {args.skip + 1}-{args.steps} per process, {args.rounds} rounds; "
              f"load average {os.getloadavg()[0]:.1f} at the start")
        print("| layout | before samples/s | after samples/s | after / before (median of rounds) | range |")
        print("|---|---:|---:|---:|---:|")
        for layout in args.layouts.split(","):
            def measure(side: str, r: int, layout: str = layout) -> float:
                return rate(sides[side], data, Path(tmp) / f"{side}-{layout.replace(' ', '-')}-{r}", layout, args)

            print(side_by_side(layout, args.rounds, measure), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
