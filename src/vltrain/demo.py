"""``vltrain demo``: synthetic shapes -> tokenizer -> training -> retrieval metrics -> plot.

One command that shows the whole product learning something real on a laptop CPU: 10,000
training rows (a fifth of them text-only), 1,000 held-out pairs, the demo config.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vltrain.config import ConfigError, load_config

NUM_TRAIN, NUM_VAL, TEXT_ONLY_FRACTION = 10_000, 1_000, 0.2
TOKENIZER_VOCAB = 512


def demo_config_path() -> Path:
    """configs/demo.yaml of the checkout (editable install) or the copy shipped in the package."""
    for candidate in (
        Path(__file__).resolve().parents[2] / "configs" / "demo.yaml",
        Path(__file__).resolve().parent / "configs" / "demo.yaml",
    ):
        if candidate.exists():
            return candidate
    raise ConfigError("configs/demo.yaml is missing from this installation")


def prepare_data(data: Path, num: int = NUM_TRAIN, val: int = NUM_VAL, seed: int = 0) -> Path:
    """Write the shapes and a tokenizer trained on their texts, unless already there."""
    from vltrain.data.synth import synthesize
    from vltrain.data.text import source_texts, train_tokenizer

    if not ((data / "train.jsonl").exists() and (data / "val.jsonl").exists()):
        print(f"writing {num:,} training rows and {val:,} held-out pairs to {data}", flush=True)
        synthesize(data, num, val, text_only_fraction=TEXT_ONLY_FRACTION, seed=seed)
    tokenizer = data / "tokenizer.json"
    if not tokenizer.exists():
        train_tokenizer(source_texts([str(data / "train.jsonl")]), tokenizer, vocab_size=TOKENIZER_VOCAB)
    return tokenizer


def run_demo(run_dir: Path, data: Path, overrides: list[str], num: int = NUM_TRAIN, val: int = NUM_VAL):
    """Train the demo config end to end; returns (trainer, final eval metrics)."""
    from vltrain.train import Trainer

    tokenizer = prepare_data(data, num, val)
    cfg = load_config(demo_config_path(), [
        f"run.dir={run_dir}",
        f"data.train={data / 'train.jsonl'}",
        f"data.val={data / 'val.jsonl'}",
        f"data.tokenizer={tokenizer}",
        *overrides,
    ])
    trainer = Trainer(cfg)
    clean = False
    try:
        metrics = trainer.train()
        clean = True
    finally:
        trainer.close(clean)
    return trainer, metrics


def demo_cli(args: argparse.Namespace) -> int:
    from vltrain.evaluate import format_metrics

    start = time.perf_counter()
    run_dir = Path(args.dir)
    trainer, metrics = run_demo(run_dir, Path(args.data), list(args.overrides or []), args.num, args.val)
    if trainer.world.is_main:
        minutes = (time.perf_counter() - start) / 60
        print(f"\ndone in {minutes:.1f} min, {trainer.step} steps, {trainer.samples_seen:,} samples")
        if metrics:
            print(f"held-out retrieval ({metrics['num_pairs']} pairs): {format_metrics(metrics)}")
            print(f"text->image R@1 = {metrics['t2i_r1']:.3f} (chance: {1 / max(metrics['num_pairs'], 1):.3f})")
        print(f"run:     {run_dir}  (metrics.jsonl, eval.json, tb/ for TensorBoard)")
        print(f"curves:  {run_dir / 'curves.png'}")
    return 0
