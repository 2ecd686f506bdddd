"""A LoRA run's set-up (``train.lora``): the base written once beside the checkpoints, then the
adapters on the model, fresh or read from a peft folder."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from vltrain.checkpoint.manager import write_whole_once
from vltrain.checkpoint.paths import LORA_BASE_FILE
from vltrain.config.job import JobConfig
from vltrain.model.lora import add_adapters

log = logging.getLogger(__name__)


def adapt(model: torch.nn.Module, cfg: JobConfig, run_dir: Path, is_main: bool) -> None:
    """Rank 0 writes the base (the weights before the adapters, while whole; once: a resumed run's
    base is the same) to the checkpoints folder; every rank then adds the adapters, fresh (the same
    on every rank: drawn after the same seed) or read from ``train.lora.adapters``, and freezes the
    rest."""
    lora = cfg.train.lora
    if is_main:
        write_whole_once(run_dir / cfg.checkpoint.folder / LORA_BASE_FILE, model)
    names = add_adapters(model, lora)
    if lora.adapters:
        from vltrain.model.interop.peft_adapters import read_adapters  # peft's folder, only when named

        read_adapters(model, lora, cfg.model.init)
    if is_main:
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info(f"LoRA: rank {lora.rank} adapters on {len(names)} layers ({', '.join(lora.targets)} of "
                 f"{', '.join(lora.towers)}); {trained:,} of {total:,} parameters train")
