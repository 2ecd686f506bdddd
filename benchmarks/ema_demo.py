"""Held-out metrics of the demo run's trained weights and of their EMA (``train.ema``), side by side.

Each decay is one ``vltrain demo`` run (the shapes data, ``configs/demo.yaml``: tiny-albef, ITC +
ITM, bf16 where the CPU has bf16 matrix instructions) at a pinned step count, so the runs differ in
the decay alone; the loop's evaluation reports both sets of weights on the same 1,000 held-out
pairs and the zero-shot shape classes at every ``eval.every`` steps. Printed: per run and
evaluation, the decay the update of that step used (with ``--warmup`` it reaches 0.99 only after
about 1,000 updates), t2i and i2t R@1 and zero-shot top-1, trained and averaged.

    PYTHONPATH=src python benchmarks/ema_demo.py [--steps 800] [--decays 0.99,0.998] [--warmup]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def run(data: Path, run_dir: Path, steps: int, decay: float, warmup: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "vltrain", "demo", "--dir", str(run_dir), "--data", str(data),
           "model.preset=tiny-albef", f"train.max_steps={steps}", f"train.ema.decay={decay}", f"train.ema.warmup={str(warmup).lower()}",
           "metrics.curves=false"]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"demo run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    print(f"  decay {decay}: {steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    return json.loads((run_dir / "eval.json").read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--decays", default="0.99,0.998")
    p.add_argument("--warmup", action="store_true", help="train.ema.warmup (timm's ModelEmaV3 schedule)")
    args = p.parse_args()
    decays = [float(d) for d in args.decays.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shapes"
        for decay in decays:
            for record in run(data, Path(tmp) / f"run-{decay}", args.steps, decay, args.warmup):
                rows.append((decay, record))
    print(f"\ndemo (tiny-albef, {args.steps} steps), {cpu_name()} ({os.cpu_count()} cores), "
          f"EMA warm-up {'on' if args.warmup else 'off'}, {time.strftime('%Y-%m-%d')}")
    print("| decay | step | decay in use | t2i R@1 trained | t2i R@1 EMA | i2t R@1 trained | i2t R@1 EMA "
          "| zero-shot top-1 trained | zero-shot top-1 EMA |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for decay, r in rows:
        zs = "zeroshot/shapes/top1"
        used = min(decay, 1 - (1 + r["step"]) ** (-2 / 3)) if args.warmup else decay  # train.ema.warmup's
        print(f"| {decay} | {r['step']} | {used:.4f} | {r['t2i_r1']:.3f} | {r['ema/t2i_r1']:.3f} | {r['i2t_r1']:.3f} | "
              f"{r['ema/i2t_r1']:.3f} | {r.get(zs, float('nan')):.3f} | {r.get('ema/' + zs, float('nan')):.3f} |")


if __name__ == "__main__":
    main()
