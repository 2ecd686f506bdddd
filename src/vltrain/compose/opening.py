"""The one door to open a model: a path in, the model, its tokenizer, its config and its
preprocessing out.

``vltrain eval``, ``embed`` and ``export`` open what they are given here, and ``model.init`` of a
vltrain checkpoint or export reads its weights here (:func:`load_weights`). What the path is comes
from :func:`vltrain.checkpoint.paths.locate`.

The rules, the same for every command:

- **Config.** A run or checkpoint: the config saved in the checkpoint (the run's when the checkpoint
  has none); an export: its config.yaml; a Hugging Face folder or an OpenCLIP file: ``model.init`` of
  it (:func:`vltrain.compose.builders.resolve_init`), in fp32 unless ``train.precision`` is given (someone
  else's checkpoint: its numbers as they are). Dotted overrides apply on top.
- **Tokenizer.** The copy saved with the weights (a checkpoint's or an export's tokenizer.json), else
  ``data.tokenizer``; ``data.tokenizer`` is set to the one used, so that data built from the config
  (evaluation) reads the same one. An imported checkpoint's is the tokenizer.json beside it unless
  ``data.tokenizer`` names one (an OpenCLIP file may have none).
- **Weights.** Built for the config, then filled: a checkpoint through DCP (any sharding), an export's
  safetensors (shapes checked first), an imported checkpoint through ``model.init``'s conversion.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from vltrain.checkpoint.manager import check_shapes, load_model_weights
from vltrain.checkpoint.paths import EXPORT, IMPORTED, Located, locate
from vltrain.config.job import JobConfig, load_config
from vltrain.data.config import DataConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.model import VLModel
from vltrain.model.interop.pretrained import read_shapes, read_state_dict
from vltrain.compose.builders import build_model_for, build_tokenizer, fit_native, resolve_init


@dataclass
class Opened:
    """A model ready to use, with what it must be fed."""

    model: VLModel
    """In eval mode, on the device asked for."""
    tokenizer: Tokenizer
    cfg: JobConfig
    located: Located

    @property
    def preprocessing(self) -> DataConfig:
        """Image size, resize, statistics, text length: the data section the model was trained with."""
        return self.cfg.data


def model_config(found: Located, overrides: list[str] | None = None) -> JobConfig:
    """The config that rebuilds the model ``found`` holds (the module's rules), with ``overrides``."""
    overrides = list(overrides or [])
    if found.kind not in IMPORTED:
        cfg = load_config(found.config_file(), overrides)
    else:
        cfg = load_config(None, [f"model.init={found.path}", *overrides])
        resolve_init(cfg)
        if not any(o.startswith("train.precision=") for o in overrides):
            cfg.train.precision = "fp32"
    fit_native(cfg)  # the patch side images are cut into: the architecture's
    return cfg


def open_tokenizer(found: Located, cfg: JobConfig) -> Tokenizer:
    """The saved copy, else ``data.tokenizer``; ``cfg.data.tokenizer`` then names the one used."""
    saved = found.saved_tokenizer()
    if saved is not None:
        cfg.data.tokenizer = str(saved)
    return build_tokenizer(cfg)


def open_model(path: str | Path | Located, overrides: list[str] | None = None, device: str | torch.device = "cpu",
               cfg: JobConfig | None = None, ema: bool = False) -> Opened:
    """Open whatever ``path`` is (:func:`~vltrain.checkpoint.paths.locate`); ``cfg``: the config
    :func:`model_config` gave, when the caller has set more in it (``overrides`` then apply no more);
    ``ema``: a run's or checkpoint's EMA weights (``train.ema``) instead of its trained ones."""
    found = path if isinstance(path, Located) else locate(path)
    if ema and (found.kind in IMPORTED or found.kind == EXPORT):
        raise UserError(f"--ema reads the EMA weights (train.ema) a vltrain run keeps in its checkpoints; "
                        f"{found.path} is {'an export' if found.kind == EXPORT else 'an imported checkpoint'}, "
                        "which holds one set of weights: drop --ema (an export made with --ema holds the EMA's)")
    cfg = cfg if cfg is not None else model_config(found, overrides)
    tokenizer = open_tokenizer(found, cfg)
    model = build_model_for(cfg, tokenizer, load_init=found.kind in IMPORTED)
    load_weights(found, model, ema=ema)
    return Opened(model.to(device).eval(), tokenizer, cfg, found)


def load_weights(found: Located, model: torch.nn.Module, ema: bool = False) -> None:
    """Fill ``model`` (on the CPU, built for the saved config) with the weights vltrain saved at
    ``found`` (``ema``: a checkpoint's EMA of them); an imported checkpoint's were loaded as the
    model was built."""
    if found.kind in IMPORTED:
        return
    if found.kind != EXPORT:
        load_model_weights(found.weights, model, ema=ema)
        return
    file = found.weights
    check_shapes(str(file), read_shapes(file), {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict(read_state_dict(file))
