"""Distillation on the demo: a small student trained with and without a teacher at equal steps, its
held-out retrieval and zero-shot accuracy; and what the teacher costs, run live against stored.

The teacher is the demo's own model trained longer (``configs/demo.yaml``: tiny-albef, ITC + ITM,
``--teacher-steps``). The students are tiny-clip (the same towers without the fusion layer) trained
for ``--steps`` on the same shapes data, in the same config, differing only in the teacher:

- none: ITC alone;
- live: ITC + ``model.loss.distill`` (``--weight``) from the teacher, which runs every step;
- stored: the same loss from the embeddings ``vltrain data teacher-embed`` stored beforehand.

Printed: per student its held-out t2i / i2t R@1, zero-shot top-1 on the shape classes, training
samples/s (the median of the logged windows after the first) and wall time; and the embedding
pass's time. A live teacher and its stored embeddings give the same curve within bf16 rounding.

    PYTHONPATH=src python benchmarks/distill_demo.py [--steps 300] [--teacher-steps 1000] [--weight 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ema_demo import cpu_name  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]


def vltrain(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "vltrain", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=REPO)
    took = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"vltrain {' '.join(map(str, args[:3]))} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return proc, took


def demo(data: Path, run_dir: Path, steps: int, *overrides: str) -> float:
    # tiny-albef: the demo's model when these figures were recorded; a student's preset overrides it
    _, took = vltrain("demo", "--dir", run_dir, "--data", data, "model.preset=tiny-albef", f"train.max_steps={steps}",
                      "metrics.curves=false", f"eval.every={steps}", *overrides)
    return took


def samples_per_second(run_dir: Path) -> float:
    rates = [r["samples_per_s"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
             if "samples_per_s" in r]
    return statistics.median(rates[1:] or rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=300, help="each student's steps")
    p.add_argument("--teacher-steps", type=int, default=1000)
    p.add_argument("--weight", type=float, default=1.0, help="model.loss.distill")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data, teacher = tmp / "shapes", tmp / "teacher"
        took = demo(data, teacher, args.teacher_steps)
        t = json.loads((teacher / "eval.json").read_text())[-1]
        print(f"teacher (tiny-albef, {args.teacher_steps} steps): {took:.0f} s", flush=True)
        student = ["model.preset=tiny-clip", "model.loss.itm=0"]
        distil = [f"model.loss.distill={args.weight}", f"model.teacher.path={teacher}"]
        for name, extra in (("none", []), ("live", distil)):
            took = demo(data, tmp / name, args.steps, *student, *extra)
            rows.append((name, tmp / name, took))
            print(f"student {name}: {took:.0f} s", flush=True)
        _, embed_took = vltrain("data", "teacher-embed", teacher, "--config", tmp / "live" / "config.yaml")
        print(f"teacher-embed: {embed_took:.0f} s", flush=True)
        took = demo(data, tmp / "stored", args.steps, *student, *distil, "model.teacher.precomputed=true")
        rows.append(("stored", tmp / "stored", took))
        zs = "zeroshot/shapes/top1"
        print(f"\nstudents: tiny-clip, {args.steps} steps of the demo config; teacher: the demo (tiny-albef) at "
              f"{args.teacher_steps} steps (t2i R@1 {t['t2i_r1']:.3f}, zero-shot {t.get(zs, float('nan')):.3f}); "
              f"{cpu_name()} ({os.cpu_count()} cores), {time.strftime('%Y-%m-%d')}")
        print(f"teacher embeddings of the training rows stored in {embed_took:.0f} s (one process, bf16 as the "
              "config, float16 on disk)")
        print("| student | distill weight | t2i R@1 | i2t R@1 | mean recall | zero-shot top-1 | samples/s | wall s |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for name, run_dir, took in rows:
            r = json.loads((run_dir / "eval.json").read_text())[-1]
            weight = 0 if name == "none" else args.weight
            print(f"| {name} | {weight:g} | {r['t2i_r1']:.3f} | {r['i2t_r1']:.3f} | {r['mean_recall']:.3f} | "
                  f"{r.get(zs, float('nan')):.3f} | {samples_per_second(run_dir):.0f} | {took:.0f} |")


if __name__ == "__main__":
    main()
