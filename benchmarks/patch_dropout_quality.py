"""Patch dropout's quality at equal wall-clock on the demo: dropout 0.5 with an unmasked phase at the
end (FLIP's recipe) against no dropout, both trained for the same time, two seeds.

Each arm's training rate is measured first with the demo's own probe (``vltrain.demo.probe_rate``:
45 steps of the config on its data, the loader included). The budget is what ``--steps`` steps
without dropout take; the dropout arm gets the steps that fit the same budget when its last
``--unmasked`` share of them runs at the rate without dropout: N = budget / (share_masked / rate_p +
share_unmasked / rate_0), ``model.vision.patch_dropout_until`` = its masked steps. Each run is
``vltrain demo`` (the shapes data, tiny-albef: 48 px images cut into 9 patches of 16 px, 5 kept at
0.5) with the steps pinned, evaluated at the end: held-out retrieval (1,000 pairs) and zero-shot
shape classes. Printed: per arm and seed the steps, the measured training wall time and the metrics.

With ``--emoji PACKAGE`` the set is a real one instead: Google's emoji captioned with their Unicode
names (``benchmarks/emoji_set.py``: 3,408 training pairs, 378 held out), and the model tiny-clip at
96 px (36 patches of 16 px, 18 kept at 0.5), whose step the vision tower dominates (captions of a
few words); ``vltrain train`` on the demo config, evaluated at the end on the held-out retrieval and
a zero-shot set of five skin tones. fp32 on a CPU without bf16 matrix instructions.

    PYTHONPATH=src python benchmarks/patch_dropout_quality.py [--steps 600] [--dropout 0.5] [--unmasked 0.1]
        [--emoji PACKAGE] [--dropout-steps N --only-dropout]

The probes run 45 steps each and can miss the runs' rates by a fifth; ``--dropout-steps`` pins the
dropout arm's steps instead (say, from the rates the first runs measured), and ``--only-dropout``
runs that arm alone.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from _demo_model import fp32_here
from emoji_set import build as build_emoji
from ema_demo import cpu_name  # benchmarks/ is on sys.path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vltrain.demo import demo_config_path, prepare_data, probe_rate  # noqa: E402

EMOJI = ["model.preset=tiny-clip", "data.image_size=96", "model.loss.caption=0", "model.loss.itm=0"]
"""The emoji arms' model: tiny-clip's towers, ITC alone."""


def rate_of(data: Path, tokenizer: Path, *overrides: str) -> float:
    """Samples/s of the demo config with ``overrides``, measured by the demo's own probe."""
    given = [f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}", f"data.tokenizer={tokenizer}",
             *overrides]
    return probe_rate(given)


def train_emoji(data: Path, tokenizer: Path, run_dir: Path, steps: int, *overrides: str) -> dict:
    """One emoji arm through ``vltrain train``; the final eval's metrics."""
    skin = data / "skin"
    cmd = [sys.executable, "-m", "vltrain", "train", str(demo_config_path()), f"run.dir={run_dir}",
           f"data.train={data / 'train.jsonl'}", f"data.val={data / 'val.jsonl'}", f"data.tokenizer={tokenizer}",
           *EMOJI, *fp32_here(), f"train.max_steps={steps}", f"eval.every={steps}", "metrics.curves=false",
           f"eval.zeroshot=[{{name: skin, path: '{skin}', templates: '{skin / 'templates.txt'}'}}]", *overrides]
    return final_metrics(cmd, run_dir)


def demo(data: Path, run_dir: Path, steps: int, *overrides: str) -> dict:
    cmd = [sys.executable, "-m", "vltrain", "demo", "--dir", str(run_dir), "--data", str(data),
           "model.preset=tiny-albef", f"train.max_steps={steps}", f"eval.every={steps}", "metrics.curves=false", *overrides]
    return final_metrics(cmd, run_dir)


def final_metrics(cmd: list[str], run_dir: Path) -> dict:
    """Run ``cmd`` (a training command writing ``run_dir``); the metrics of its last evaluation."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if proc.returncode:
        raise SystemExit(f"the run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads((run_dir / "eval.json").read_text())[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600, help="steps of the arm without dropout")
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--unmasked", type=float, default=0.1, help="share of the dropout arm's steps without dropout")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--emoji", type=Path, help="an unpacked emoji-datasource-google package: train on the emoji")
    p.add_argument("--dropout-steps", type=int, default=0,
                   help="the dropout arm's steps, instead of the probes' (e.g. from the rates the runs measured)")
    p.add_argument("--only-dropout", action="store_true", help="run the dropout arm alone")
    args = p.parse_args()
    batch = 128
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.emoji:
            data = Path(tmp) / "emoji"
            tokenizer = build_emoji(args.emoji, data)
            model, run = EMOJI, partial(train_emoji, data, tokenizer)
        else:
            data = Path(tmp) / "shapes"
            tokenizer = prepare_data(data, 20000, 1000)
            model, run = ["model.preset=tiny-albef"], partial(demo, data)
        if args.dropout_steps:
            steps, budget = args.dropout_steps, float("nan")
        else:
            r0 = rate_of(data, tokenizer, *model, *fp32_here())
            rp = rate_of(data, tokenizer, *model, *fp32_here(), f"model.vision.patch_dropout={args.dropout}")
            budget = args.steps * batch / r0
            steps = int(budget / batch / ((1 - args.unmasked) / rp + args.unmasked / r0))
            print(f"rates: {r0:.0f} samples/s without dropout, {rp:.0f} at {args.dropout} ({rp / r0:.2f}x); budget "
                  f"{budget:.0f} s: {args.steps} steps against {steps}", flush=True)
        until = int(round(steps * (1 - args.unmasked)))
        arms = {"none": (args.steps, []),
                f"{args.dropout}": (steps, [f"model.vision.patch_dropout={args.dropout}",
                                           f"model.vision.patch_dropout_until={until}"])}
        for seed in [int(s) for s in args.seeds.split(",")]:
            for name, (n, extra) in arms.items():
                if name == "none" and args.only_dropout:
                    continue
                start = time.perf_counter()
                metrics = run(Path(tmp) / f"{name}-{seed}", n, f"train.seed={seed}", *extra)
                rows.append((name, seed, n, time.perf_counter() - start, metrics))
                print(f"  {name} seed {seed}: {n} steps, {rows[-1][3]:.0f} s", flush=True)
    zs = "zeroshot/skin/top1" if args.emoji else "zeroshot/shapes/top1"
    what = ("emoji (tiny-clip at 96 px, ITC" if args.emoji else "demo (tiny-albef") + \
        ", bf16 where the CPU has bf16 matrix instructions)"
    print(f"\n{what}, training time {budget:.0f} s by the probes, {cpu_name()} ({os.cpu_count()} cores), "
          f"{time.strftime('%Y-%m-%d')}")
    print("| patch dropout | seed | steps | run wall s | t2i R@1 | i2t R@1 | mean recall | zero-shot top-1 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, seed, n, took, r in rows:
        label = "0" if name == "none" else f"{name}, unmasked from step {until + 1}"
        print(f"| {label} | {seed} | {n} | {took:.0f} | {r['t2i_r1']:.3f} | {r['i2t_r1']:.3f} | {r['mean_recall']:.3f} | "
              f"{r.get(zs, float('nan')):.3f} |")


if __name__ == "__main__":
    main()
