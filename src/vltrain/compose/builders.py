"""Builders shared by training, evaluation, export and the demo: the tokenizer, the model, the task
and the data loaders a decided config describes (:mod:`vltrain.compose.decide`). Each is built here
once, so every command sees the same model and the same data pipeline. Building loads no weights:
the door does (:mod:`vltrain.compose.opening`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vltrain.compose.task import Task
from vltrain.config.job import JobConfig
from vltrain.data.dataset import build_dataset, source_specs
from vltrain.data.loading.loader import TrainLoader, build_eval_loader, build_train_loader
from vltrain.data.tokenizers import Tokenizer, load_tokenizer
from vltrain.errors import ConfigError, UserError
from vltrain.model import VLModel, build_model, hf_tokenizer_file
from vltrain.model.presets import Architecture
from vltrain.objectives.scoring import Objectives
from vltrain.runtime.distributed import World


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
    return load_tokenizer(tokenizer_path(cfg), cfg.data.text_clean)


def build_model_for(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device | str = "cpu") -> VLModel:
    """The (unwrapped) model a decided config describes, sized for the tokenizer and the data, on
    ``device``, with fresh weights: the door (:func:`vltrain.compose.opening.fill`) loads any.

    With ``model.arch`` (which ``model.init`` of an imported checkpoint decides) the architecture and
    its vocabulary and positions are the checkpoint's."""
    vocab_size, max_text_length, arch = tokenizer.vocab_size, cfg.data.max_text_length, None
    if cfg.model.init or cfg.model.arch:
        if not cfg.model.arch:
            raise ConfigError("model.init is set but not decided: open the config with vltrain.compose.decide.decide")
        arch = Architecture.from_dict(cfg.model.arch)
        vocab_size, max_text_length = _check_fits_init(cfg, tokenizer, arch)
    model = build_model(
        cfg.model, vocab_size=vocab_size, pad_id=tokenizer.pad_id, mask_id=tokenizer.mask_id,
        image_size=cfg.data.image_size, max_text_length=max_text_length,
    )
    locca = getattr(model.decoder, "vocab", None) is not None  # its task tokens start its rows
    if locca and tokenizer.eos_id is None:
        raise UserError(f"data.tokenizer {cfg.data.tokenizer}: LocCa's decoder ends each phrase and caption at the end "
                        "token, and this tokenizer has none ([SEP], </s>, <|endoftext|>); use one that has it")
    if model.decoder is not None and not locca and (tokenizer.cls_id is None or tokenizer.eos_id is None):
        raise UserError(f"data.tokenizer {cfg.data.tokenizer}: a captioning decoder predicts each caption from its "
                        "start token to its end token, and this tokenizer has no start ([CLS], <s>, "
                        "<|startoftext|>) or no end token ([SEP], </s>, <|endoftext|>); use one that has both, or "
                        "set model.loss.caption=0")
    return model.to(device)


def _check_fits_init(cfg: JobConfig, tokenizer: Tokenizer, arch: Architecture) -> tuple[int, int]:
    """The checkpoint's vocabulary and positions, once the data and tokenizer fit them."""
    where = cfg.model.init or "model.arch"
    if cfg.data.image_size != arch.vision.image_size:
        raise ConfigError(f"data.image_size {cfg.data.image_size} differs from {where}'s {arch.vision.image_size} "
                          "(its position embedding is for that size); leave data.image_size unset")
    if cfg.data.max_text_length > arch.text.max_length:
        raise ConfigError(f"data.max_text_length {cfg.data.max_text_length} exceeds {where}'s "
                          f"{arch.text.max_length} positions")
    if tokenizer.vocab_size > arch.text.vocab_size:
        raise ConfigError(f"the tokenizer ({tokenizer.path}) has {tokenizer.vocab_size} tokens but {where}'s "
                          f"embedding {arch.text.vocab_size}: use the checkpoint's own tokenizer.json")
    if cfg.model.embed_dim not in (0, arch.embed_dim):
        raise ConfigError(f"model.embed_dim {cfg.model.embed_dim} differs from {where}'s {arch.embed_dim}; leave it 0")
    return arch.text.vocab_size, arch.text.max_length


def build_task(cfg: JobConfig, model: VLModel) -> Task:
    """The model with the objectives of the decided ``model.loss`` (:func:`vltrain.compose.rules.decide_objectives`)."""
    return Task(model, Objectives(cfg.model.loss, model.spec, cfg.model.vision, cfg.model.selfdist))


def build_train_loader_for(cfg: JobConfig, tokenizer: Tokenizer, world: World, run_dir: Path,
                           teacher=None) -> TrainLoader:
    """``teacher``: a :class:`vltrain.data.teacher_store.TeacherInputs`, or a function of the opened sources
    that makes one (stored embeddings are found beside each source's index)."""
    dataset = build_dataset(cfg.data, "train", tokenizer, run_dir=run_dir, plan_aware=True)
    dataset.teacher = teacher(dataset.sources) if callable(teacher) else teacher
    loader = build_train_loader(
        cfg.data, dataset, rank=world.rank, world_size=world.world_size, seed=cfg.train.seed,
        run_dir=run_dir, pad_id=tokenizer.pad_id,
    )
    loader.teacher = dataset.teacher  # what to_model_inputs reads the teacher's part of a batch with
    return loader


def build_val_loader(cfg: JobConfig, tokenizer: Tokenizer, world: World, run_dir: Path | None = None):
    """The loader of ``data.val``; a set without a single image-text pair is refused, since retrieval
    recall on it would read 0.000 at every evaluation and mean nothing."""
    dataset = build_dataset(cfg.data, "val", tokenizer, run_dir=run_dir)
    table = dataset.table()
    pairs = int((table.has_image & table.has_text).sum())
    if pairs == 0:
        names = ", ".join(s.path for s in source_specs(cfg.data.val))
        text_only = int((table.has_text & ~table.has_image).sum())
        image_only = int((table.has_image & ~table.has_text).sum())
        raise ConfigError(
            f"data.val ({names}) holds no image-text pairs ({len(table)} rows: {text_only} text-only, "
            f"{image_only} image-only), so retrieval recall on it would mean nothing. Give a val set with "
            "pairs, or data.val='' to train without it (eval.zeroshot and eval.retrieval sets still run)."
        )
    # eval.max_samples: the rows up to the Nth pair, so that every world size scores the same pairs
    paired = np.flatnonzero(np.asarray(table.has_image & table.has_text))
    rows = int(paired[cfg.eval.max_samples - 1]) + 1 if 0 < cfg.eval.max_samples < len(paired) else len(table)
    return build_eval_loader(
        cfg.data, dataset, rank=world.rank, world_size=world.world_size, batch_size=cfg.eval.batch_size,
        pad_id=tokenizer.pad_id, rows=rows,
    )
