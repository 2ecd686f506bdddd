"""Data and in-process trainers for the SPMD tests (real gloo ranks from ``multiproc.run_world``).

The shapes data here is built so that ranks disagree as much as the promise allows: about 40% of
the rows are text-only, 15% image-only, and a 512-token vocabulary leaves captions of 9 to 32
tokens, so two ranks' micro-batches of 4 pad to different widths in many steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

MICRO_BATCH = 4


def make_mixed_shapes(root: Path) -> Path:
    """Shapes with text-only, image-only and paired rows, and a tokenizer whose captions vary in length."""
    from vltrain.data.tools.synth import synthesize
    from vltrain.data.tools.tokenizer_training import source_texts, train_tokenizer

    if (root / "tokenizer.json").exists():
        return root
    synthesize(root, 160, 16, text_only_fraction=0.5, seed=3, image_size=32)
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    with_image = [r for r in rows if r.get("image")]
    for r in with_image[::4]:  # every fourth image row loses its caption: image-only
        r.pop("text", None)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [t for t in source_texts([str(root / "val.jsonl")])] + [r.get("text") for r in rows]
    train_tokenizer([t for t in texts if t], root / "tokenizer.json", vocab_size=512)
    return root


def modality_counts(root: Path) -> dict[str, int]:
    rows = [json.loads(line) for line in (root / "train.jsonl").read_text().splitlines()]
    return {
        "rows": len(rows),
        "text_only": sum(1 for r in rows if r.get("text") and not r.get("image")),
        "image_only": sum(1 for r in rows if r.get("image") and not r.get("text")),
    }


def config(root: Path, run_dir: Path, overrides: list[str]):
    from vltrain.config.job import load_config

    base = [
        f"run.dir={run_dir}", f"data.train={root / 'train.jsonl'}", "data.val=''",
        f"data.tokenizer={root / 'tokenizer.json'}", "data.image_size=32", "data.mean=[0.5,0.5,0.5]",
        "data.std=[0.5,0.5,0.5]", "data.max_text_length=32", f"data.batch_size={MICRO_BATCH}",
        "data.num_workers=0", "train.precision=fp32", "train.threads=1", "train.progress=false",
        "train.warmup_steps=1", "train.log_every=1", "train.timeout_s=60", "train.resume=never",
        "train.debug_spmd=true", "checkpoint.every=0",
    ]
    return load_config(None, base + overrides)


def run_trainer(cfg, save: bool = True) -> dict:
    """Train ``cfg`` in this (already joined) process group; the group stays up afterwards.

    Returns the per-step losses and this rank's padded text width of every micro-batch.
    ``save`` false: the run's last checkpoint is not written (over half of a 4-step run's time).
    """
    from vltrain.train.metrics import read_jsonl
    from vltrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    widths: list[tuple[int, ...]] = []
    take = trainer._next_micro_batches

    def spy():
        micro, wait = take()
        widths.append(tuple(int(b.input_ids.shape[1]) for b in micro))
        return micro, wait

    trainer._next_micro_batches = spy
    if not save:
        trainer._checkpoint = lambda final: None
    try:
        trainer.train()
    finally:
        trainer.metrics.close()
    losses = [r["loss"] for r in read_jsonl(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r] \
        if trainer.world.is_main else []
    return {"widths": widths, "losses": losses, "steps": trainer.step,
            "finite": all(torch.isfinite(torch.tensor(v)) for v in losses)}
