"""LocCa on the demo's shapes with regions: what its three tasks give the encoder and what they cost.

tiny-siglip2 (SigLIP 2's layout at the demo's size: a MAP-pooled ViT, the sigmoid loss, a one-layer
LocCa decoder) trained by ``vltrain demo`` for ``--steps`` at the demo's batch on the same data
(``vltrain data synth --regions``: each shape's box and its own phrase), differing only in the
decoder's tasks:

- sigmoid: the sigmoid loss alone (no decoder is built);
- +caption: with the decoder's captions;
- LocCa: captions, referring expressions and grounded captions, half of each decoded in parallel
  (SigLIP 2's recipe);
- LocCa causal: the same, every task decoded causally (``parallel_prediction`` 0);
- LocCa parallel: every task decoded in parallel (``parallel_prediction`` 1).

Printed: per run the held-out t2i / i2t R@1, zero-shot top-1 on the shape classes, referring
Acc@0.5 and mean IoU on 200 held-out phrases (the runs with a decoder), the median seconds of a
step (after the first logged window) and the wall time. Runs are at equal steps; the step time
gives the equal-time comparison.

    PYTHONPATH=src python benchmarks/locca_demo.py [--steps 600]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from distill_demo import vltrain  # benchmarks/ is on sys.path
from ema_demo import cpu_name

RUNS = {
    "sigmoid": ["model.loss.caption=0", "model.loss.referring=0", "model.loss.grounded_caption=0"],
    "+caption": ["model.loss.referring=0", "model.loss.grounded_caption=0"],
    "LocCa": ["model.loss.parallel_prediction=0.5"],
    "LocCa causal": ["model.loss.parallel_prediction=0"],
    "LocCa parallel": ["model.loss.parallel_prediction=1"],
}
BASE = ["model.preset=tiny-siglip2", "model.loss.itc=0", "model.loss.siglip=1", "model.loss.caption=1",
        "metrics.curves=false"]


def seconds_per_step(run_dir: Path, batch: int) -> float:
    rates = [r["samples_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "samples_per_s" in r]
    return batch / statistics.median(rates[1:] or rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--runs", nargs="*", default=list(RUNS))
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="locca-demo-"))
    data = root / "shapes"
    rows = []
    for name in args.runs:
        run_dir = root / name.replace(" ", "-").replace("+", "")
        _, took = vltrain("demo", "--dir", run_dir, "--data", data, *BASE, *RUNS[name], f"train.max_steps={args.steps}",
                          f"eval.every={args.steps}", f"data.batch_size={args.batch}")
        m = json.loads((run_dir / "eval.json").read_text())[-1]
        rows.append((name, m, seconds_per_step(run_dir, args.batch), took))
    print(f"CPU: {cpu_name()}; {args.steps} steps of {args.batch}; tiny-siglip2 on the shapes with regions")
    print("| run | t2i R@1 | i2t R@1 | zero-shot top-1 | referring Acc@0.5 | mean IoU | s/step | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, m, step, took in rows:
        acc = m.get("referring/shapes/acc50")
        ref = f"{acc:.3f} | {m['referring/shapes/miou']:.3f}" if acc is not None else "- | -"
        print(f"| {name} | {m['t2i_r1']:.3f} | {m['i2t_r1']:.3f} | {m['zeroshot/shapes/top1']:.3f} | {ref} | "
              f"{step:.3f} | {took:.0f} |")


if __name__ == "__main__":
    main()
