"""The demo config's model and random batches of its shape, shared by the trainer benchmarks."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from vltrain.config.job import load_config  # noqa: E402
from vltrain.demo import random_pairs  # noqa: E402
from vltrain.model import build_model  # noqa: E402
from vltrain.compose.builders import build_task  # noqa: E402
from vltrain.compose.task import Task  # noqa: E402
from vltrain.types import ModelInputs  # noqa: E402

VOCAB, PAD, MASK = 512, 0, 4


def demo_config(*overrides: str):
    return load_config(REPO / "configs" / "demo.yaml", list(overrides))


def demo_model(cfg=None) -> torch.nn.Module:
    cfg = cfg or demo_config()
    return build_model(cfg.model, vocab_size=VOCAB, pad_id=PAD, mask_id=MASK,
                       image_size=cfg.data.image_size, max_text_length=cfg.data.max_text_length)


def demo_task(cfg=None) -> Task:
    """``demo_model`` with its objectives: what the trainer's step runs."""
    cfg = cfg or demo_config()
    return build_task(cfg, demo_model(cfg))


def random_inputs(batch: int, cfg=None, seed: int = 0, offset: int = 0) -> ModelInputs:
    """A batch of image-text pairs; ``offset`` keeps sample ids distinct across ranks/micro-batches."""
    cfg = cfg or demo_config()
    return random_pairs(batch, cfg.data.image_size, cfg.data.max_text_length, VOCAB, seed=seed, offset=offset)


def load_average() -> str:
    return "load average %.1f / %.1f / %.1f over 1/5/15 min" % os.getloadavg()


def fp32_here() -> list[str]:
    """fp32 on a CPU that would emulate bf16 (as ``vltrain demo`` chooses); the config's precision elsewhere."""
    from vltrain.runtime.precision import cpu_has_bf16_matmul

    return [] if cpu_has_bf16_matmul() else ["train.precision=fp32"]


def sync(device: torch.device) -> None:
    """Wait for the GPU's queued work, so that a timer reads it (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
