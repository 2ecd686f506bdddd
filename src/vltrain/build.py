"""Builders shared by training, evaluation, export and the demo: the tokenizer, the model, the task
and the data loaders a config describes. Each is decided here once, so every command sees the same model
and the same data pipeline."""

from __future__ import annotations

from pathlib import Path

import torch

from vltrain.config import JobConfig
from vltrain.data.dataset import build_dataset, source_specs
from vltrain.data.loader import TrainLoader, build_eval_loader, build_train_loader
from vltrain.data.text import Tokenizer, load_tokenizer
from vltrain.distributed import World
from vltrain.errors import ConfigError
from vltrain.model import VLModel, build_model, hf_tokenizer_file
from vltrain.objectives import Objectives
from vltrain.task import Task


def tokenizer_path(cfg: JobConfig) -> str:
    """``data.tokenizer``, or the Hugging Face text encoder's own ``tokenizer.json``."""
    path = cfg.data.tokenizer
    if not path and cfg.model.text.hf_path:
        path = str(hf_tokenizer_file(cfg.model.text.hf_path))  # the encoder's own vocabulary
    if not path:
        raise ConfigError(
            "data.tokenizer is empty: set it to a tokenizer.json (e.g. one made by `vltrain tokenizer train "
            "MANIFEST --out tok.json`), or set model.text.hf_path to a Hugging Face encoder folder"
        )
    if not (Path(path).is_file() or (Path(path) / "tokenizer.json").is_file()):
        sources = " ".join(s.path for s in source_specs(cfg.data.train)) or "TRAIN_MANIFEST"
        raise ConfigError(
            f"tokenizer not found: {path} (data.tokenizer). Train one on the training captions:\n"
            f"  vltrain tokenizer train {sources} --out {path}\n"
            "or point data.tokenizer to an existing tokenizer.json (`vltrain data synth` writes one beside its data)"
        )
    return path


def build_tokenizer(cfg: JobConfig) -> Tokenizer:
    return load_tokenizer(tokenizer_path(cfg))


def build_model_for(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device | str = "cpu") -> VLModel:
    """The (unwrapped) model a config describes, sized for the tokenizer and the data, on ``device``."""
    model = build_model(
        cfg.model, vocab_size=tokenizer.vocab_size, pad_id=tokenizer.pad_id, mask_id=tokenizer.mask_id,
        image_size=cfg.data.image_size, max_text_length=cfg.data.max_text_length,
    )
    return model.to(device)


def build_task(cfg: JobConfig, model: VLModel) -> Task:
    """The model with the objectives ``model.loss`` asks for (those the model has heads for)."""
    return Task(model, Objectives(cfg.model.loss, model))


def build_train_loader_for(cfg: JobConfig, tokenizer: Tokenizer, world: World, run_dir: Path) -> TrainLoader:
    dataset = build_dataset(cfg.data, "train", tokenizer, run_dir=run_dir, plan_aware=True)
    return build_train_loader(
        cfg.data, dataset, rank=world.rank, world_size=world.world_size, seed=cfg.train.seed,
        run_dir=run_dir, pad_id=tokenizer.pad_id,
    )


def build_val_loader(cfg: JobConfig, tokenizer: Tokenizer, world: World, run_dir: Path | None = None):
    dataset = build_dataset(cfg.data, "val", tokenizer, run_dir=run_dir)
    return build_eval_loader(
        cfg.data, dataset, rank=world.rank, world_size=world.world_size, batch_size=cfg.eval.batch_size,
        pad_id=tokenizer.pad_id,
    )
