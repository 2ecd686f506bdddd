"""``model.init`` from a vltrain checkpoint: a new run (a new batch size, schedule or data) that
starts from another run's weights, with a fresh optimizer and data order.

The checkpoint's saved config gives what the weights need to load: every ``model.*`` key and the
preprocessing the position embeddings depend on, where this run's config does not set them, and the
tokenizer saved beside the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from vltrain.checkpoint.manager import CONFIG_FILE, STATE_FILE, find_checkpoint
from vltrain.config.job import JobConfig, load_config
from vltrain.model.config import ModelConfig
from vltrain.train.build import PREPROCESSING_KEYS


def vltrain_checkpoint(init: str) -> Path | None:
    """The checkpoint ``model.init`` names if it is a vltrain one: a ``step-N`` folder, a run's
    ``checkpoints`` folder or a run folder (its latest checkpoint); None for anything else."""
    if not init:
        return None
    p = Path(init).expanduser()
    is_run = (p / CONFIG_FILE).is_file() and (p / "checkpoints").is_dir()
    if not ((p / STATE_FILE).is_file() or is_run or (p.name == "checkpoints" and p.is_dir())):
        return None
    return find_checkpoint(p)


def adopt_checkpoint_model(cfg: JobConfig, ckpt: Path) -> None:
    """Fill ``cfg`` from the checkpoint's saved config where ``cfg`` sets nothing; ``model.init`` is
    then done with (the caller loads the weights into the built model)."""
    saved = load_config(ckpt / CONFIG_FILE)
    for f in dataclasses.fields(ModelConfig):
        if f.name != "init" and not cfg.was_set(f"model.{f.name}"):
            setattr(cfg.model, f.name, getattr(saved.model, f.name))
    for key in PREPROCESSING_KEYS:
        if not cfg.was_set(f"data.{key}"):
            setattr(cfg.data, key, getattr(saved.data, key))
    tokenizer = ckpt / "tokenizer.json"
    if not cfg.data.tokenizer and tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)
    cfg.model.init = ""
