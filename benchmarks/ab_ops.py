"""The aten ops of one training step of two checkouts, compared: for a change not meant to change
the work (a redesign), whether the kernels a step runs are the same ones, and in the same order. What is
left to differ is Python around the same kernels, which a timing on a shared machine cannot resolve
to a few percent (``benchmarks/ab_step.py``, ``benchmarks/ab_train.py``).

Each side is one fresh process of the checkout's own trainer (``Trainer.train_step``: moving the
batch to the device, normalizing, forward, backward and AdamW) on the same synthetic data (written
once by the ``--after`` checkout), the demo's model at fp32, the third step logged op by op with a
``TorchDispatchMode``; one row per image layout (square, at their own shape padded, packed).

    python benchmarks/ab_ops.py --before /tmp/before --after . [--batch 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

CHILD = """
import json, sys, torch
from torch.utils._python_dispatch import TorchDispatchMode
from vltrain.config.job import load_config
from vltrain.train.trainer import Trainer

class Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

config, overrides = sys.argv[1], sys.argv[2:]
trainer = Trainer(load_config(config, overrides))
step, log, seen = trainer.train_step, Log(), []

def logged(micro):
    seen.append(1)
    if len(seen) != 3:
        return step(micro)
    with log:
        return step(micro)

trainer.train_step = logged
trainer.train()
trainer.close()
print(json.dumps(log.ops))
"""


LAYOUTS = {
    "square": [],
    "native": ["data.resize=native", "data.max_patches=16"],
    "native packed": ["data.resize=native", "data.max_patches=16", "data.pack_images=true"],
}


def trainer_overrides(run: Path, data: Path, batch: int, steps: int, layout: str) -> list[str]:
    """The demo config's overrides of a timed or logged trainer: ``data`` (written by :func:`shapes`),
    in-process loading, fp32 on one thread, nothing saved or evaluated, the layout's settings."""
    return [f"run.dir={run}", f"data.train={data / 'train.jsonl'}", "data.val=''",
            f"data.tokenizer={data / 'tokenizer.json'}", f"data.batch_size={batch}", "data.num_workers=0",
            f"train.max_steps={steps}", "train.precision=fp32", "train.progress=false", "train.threads=1",
            "eval.every=0", "checkpoint.every=0", "metrics.curves=false", *LAYOUTS[layout]]


def ops(tree: Path, data: Path, run: Path, batch: int, layout: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    out = subprocess.run([sys.executable, "-c", CHILD, str(tree / "configs" / "demo.yaml"),
                          *trainer_overrides(run, data, batch, 3, layout)],
                         check=True, capture_output=True, text=True, env=env, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def vltrain(tree: Path, *argv: str) -> None:
    subprocess.run([sys.executable, "-m", "vltrain", *argv], check=True, capture_output=True,
                   env=dict(os.environ, PYTHONPATH=str(tree / "src")), cwd=tree)


def shapes(tree: Path, out: Path, num: int) -> Path:
    """``num`` synthetic shapes and a tokenizer trained on them, written by ``tree``'s vltrain into ``out``."""
    vltrain(tree, "data", "synth", "--out", str(out), "--num", str(num), "--val", "0", "--workers", "1")
    vltrain(tree, "tokenizer", "train", str(out / "train.jsonl"), "--out", str(out / "tokenizer.json"),
            "--vocab-size", "512")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, required=True)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = shapes(args.after.resolve(), Path(tmp) / "shapes", args.batch * 4)
        print("| layout | ops before | ops after | same ops, any order | same sequence | first difference |")
        print("|---|---:|---:|---|---|---|")
        for layout in LAYOUTS:
            before, after = (ops(tree.resolve(), data, Path(tmp) / f"{side}-{layout.replace(' ', '-')}", args.batch,
                                 layout) for side, tree in (("before", args.before), ("after", args.after)))
            same = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            differ = "" if before == after else f"op {same}: {before[same:same + 1]} vs {after[same:same + 1]}"
            bag = "yes" if Counter(before) == Counter(after) else "no"
            print(f"| {layout} | {len(before)} | {len(after)} | {bag} | {'yes' if before == after else 'no'} | {differ} |",
                  flush=True)


if __name__ == "__main__":
    main()
