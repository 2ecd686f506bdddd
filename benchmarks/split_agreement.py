"""How closely one global batch split three ways trains the same model (data.global_batch_size).

For each case, three real runs of 20 fp32 steps on the shapes (64 rows: 20% text-only, every
seventh image-text row made image-only): 1 process with A = 1, 1 process accumulating A = 2
micro-batches (gradcache), and ``torchrun`` with 2 ranks. Printed: the largest relative difference
of each split against the first, in a step's loss and in the final parameters (relative norm).
The same runs ``tests/train/test_global_batch.py`` asserts within 1e-5; this prints the figures
docs/distributed.md quotes, and a "local" row for scale: the fusion model with
``itm_negatives: local``, whose ITM pools depend on the split.

    PYTHONPATH=src python benchmarks/split_agreement.py [--cases itc,siglip,...] [--global-batch 12]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vltrain.checkpoint.manager import find_checkpoint
from vltrain.checkpoint.storage import read_tensors
from vltrain.data.tools.synth import synthesize
from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

from _net import free_port

FUSION = {"model.preset": "tiny-albef", "model.loss.itm": 1, "model.loss.mlm": 0.5, "model.loss.text_mlm": 0.3}
CASES = {
    "itc": {},
    "siglip": {"model.loss.itc": 0, "model.loss.siglip": 1},
    "fusion": FUSION,
    "unimodal": {"model.loss.text_mlm": 0.3, "model.loss.image_mim": 0.3},
    "budget": {"data.batching": "budget"},
    "local": {**FUSION, "model.loss.itm_negatives": "local"},
}


def make_data(root: Path) -> Path:
    synthesize(root, 64, 16, text_only_fraction=0.2, seed=0, image_size=32)
    rows = [json.loads(x) for x in (root / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        if i % 7 == 3 and "image" in row:
            del row["text"]
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    train_tokenizer(source_texts([str(root / "train.jsonl")]), root / "tokenizer.json", vocab_size=200)
    return root


def train(data: Path, run_dir: Path, nproc: int, settings: dict) -> None:
    overrides = {
        "run.dir": run_dir, "data.train": data / "mixed.jsonl", "data.val": "''", "data.tokenizer": data / "tokenizer.json",
        "data.image_size": 32, "data.mean": "[0.5,0.5,0.5]", "data.std": "[0.5,0.5,0.5]", "data.max_text_length": 16,
        "data.num_workers": 2, "data.shuffle": True, "model.preset": "tiny-clip", "train.max_steps": 20,
        "train.warmup_steps": 2, "train.lr": 1e-3, "train.precision": "fp32", "train.threads": 1, "train.log_every": 1,
        "train.progress": False, **settings,
    }
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-addr",
           "127.0.0.1", "--master-port", str(free_port()), "-m", "vltrain", "train", str(data / "base.yaml"),
           *(f"{k}={v}" for k, v in overrides.items())]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode:
        sys.exit(f"run failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.startswith("{")]
    return [r["loss"] for r in rows if "loss" in r]


def parameters(run_dir: Path) -> torch.Tensor:
    tensors = read_tensors(find_checkpoint(run_dir))
    return torch.cat([tensors[k].flatten().double() for k in sorted(tensors) if k.startswith("model.")])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--global-batch", type=int, default=12)
    args = p.parse_args()
    g = args.global_batch
    splits = {"1 rank, A=2": (1, {"data.micro_batch_size": g // 2}), "2 ranks, A=1": (2, {})}
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(Path(tmp) / "data")
        (data / "base.yaml").write_text("{}\n")
        print(f"global batch {g}, 20 fp32 steps; largest relative difference against 1 rank, A=1")
        print(f"| case | {' | '.join(f'{s}: loss | {s}: parameters' for s in splits)} |")
        print("|---|" + "---:|" * (2 * len(splits)))
        for case in args.cases.split(","):
            settings = {"data.global_batch_size": g, **CASES[case]}
            ref = Path(tmp) / f"{case}-ref"
            train(data, ref, 1, settings)
            base, base_params = losses(ref), parameters(ref)
            cells = []
            for name, (nproc, extra) in splits.items():
                run = Path(tmp) / f"{case}-{name.replace(' ', '').replace(',', '-')}"
                train(data, run, nproc, {**settings, **extra})
                curve = losses(run)
                cells.append(max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(curve, base)))
                cells.append(float((parameters(run) - base_params).norm() / base_params.norm()))
            print(f"| {case} | " + " | ".join(f"{x:.1e}" for x in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
