"""The one door to open a model: a path (or a decided config) in, the model, its tokenizer, its
config and its preprocessing out, for every purpose: ``vltrain eval``, ``embed``, ``caption`` and
``export``, the distillation teacher, and ``model.init`` of a run.

What the path is comes from :func:`vltrain.checkpoint.paths.locate`; its config is decided by
:func:`vltrain.compose.decide.decide` (:func:`~vltrain.compose.decide.model_config` says which config
rebuilds it); the model is built with fresh weights (:func:`vltrain.compose.builders.build_model_for`)
and then filled here, by :func:`fill`, the one reader of weights:

- a vltrain checkpoint through DCP (any sharding; ``ema``: its EMA of the weights);
- an export's safetensors (shapes checked first);
- an imported checkpoint (Hugging Face, OpenCLIP) through its conversion
  (:func:`vltrain.model.interop.pretrained.load_pretrained`), described once by the decide pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from vltrain.checkpoint.manager import check_shapes, load_model_weights
from vltrain.checkpoint.paths import CONFIG_FILE, EXPORT, IMPORTED, LORA_BASE_FILE, Located, locate
from vltrain.compose.builders import build_model_for, build_tokenizer
from vltrain.compose.decide import Decided, model_config
from vltrain.config.job import JobConfig, load_config
from vltrain.data.config import DataConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.model import VLModel
from vltrain.model.lora import LoraSettings, add_adapters, merge_adapters
from vltrain.model.interop.pretrained import Pretrained, load_pretrained, read_shapes, read_state_dict

log = logging.getLogger("vltrain")


@dataclass
class Opened:
    """A model ready to use, with what it must be fed."""

    model: VLModel
    """On the device asked for; in eval mode unless it was opened to train."""
    tokenizer: Tokenizer
    cfg: JobConfig
    located: Located | None
    """Where its weights came from (None: a run's fresh weights)."""

    @property
    def preprocessing(self) -> DataConfig:
        """Image size, resize, statistics, text length: the data section the model was trained with."""
        return self.cfg.data


def open_model(path: str | Path | Located | Decided, overrides: list[str] | None = None,
               device: str | torch.device = "cpu", ema: bool = False, purpose: str = "eval",
               merge: bool = True) -> Opened:
    """Open whatever ``path`` is (:func:`~vltrain.checkpoint.paths.locate`) for ``purpose``, its config
    decided with ``overrides``; or the model a :class:`~vltrain.compose.decide.Decided` describes (a
    run's, filled from its ``model.init``; a command's, when it decided more than the overrides say).
    ``ema``: a run's or checkpoint's EMA weights (``train.ema``) instead of its trained ones.
    A LoRA run's adapters are merged into its weights, unless ``merge`` is False (``export --adapters``)."""
    decided = path if isinstance(path, Decided) else model_config(
        path if isinstance(path, Located) else locate(path), overrides, purpose)
    found = decided.weights
    if ema and found is not None and (found.kind in IMPORTED or found.kind == EXPORT):
        raise UserError(f"--ema reads the EMA weights (train.ema) a vltrain run keeps in its checkpoints; "
                        f"{found.path} is {'an export' if found.kind == EXPORT else 'an imported checkpoint'}, "
                        "which holds one set of weights: drop --ema (an export made with --ema holds the EMA's)")
    tokenizer = build_tokenizer(decided.cfg)
    model = build_model_for(decided.cfg, tokenizer)  # on the CPU, filled there, then moved
    if found is not None:
        fill(model, found, ema=ema, source=decided.imported, merge=merge)
    model = model.to(device)
    return Opened(model if decided.purpose == "train" else model.eval(), tokenizer, decided.cfg, found)


def fill(model: torch.nn.Module, found: Located, ema: bool = False, source: Pretrained | None = None,
         merge: bool = True) -> None:
    """Fill ``model`` (built for the decided config) with the weights at ``found``: a vltrain
    checkpoint's (``ema``: its EMA of them), an export's, or an imported checkpoint's (``source``: its
    description, from the decide pass). A LoRA checkpoint: its base, its adapters, then (``merge``)
    the adapters folded into the weights."""
    if found.kind in IMPORTED:
        for note in load_pretrained(model, source):
            log.info("model.init: %s", note)
    elif found.kind == EXPORT:
        file = found.weights
        check_shapes(str(file), read_shapes(file), {k: tuple(v.shape) for k, v in model.state_dict().items()})
        model.load_state_dict(read_state_dict(file))
    elif (lora := load_config(found.weights / CONFIG_FILE).train.lora).enabled:
        _fill_adapted(model, found.weights, lora, ema, merge)
    else:
        load_model_weights(found.weights, model, ema=ema)


def _fill_adapted(model: torch.nn.Module, ckpt: Path, lora: LoraSettings, ema: bool, merge: bool) -> None:
    """A LoRA run's checkpoint: the base written beside the checkpoints, the adapters on it (the
    checkpoint's, or their EMA), merged into the weights unless ``merge`` is False."""
    base = ckpt.parent / LORA_BASE_FILE
    if not base.is_file():
        raise UserError(f"checkpoint {ckpt} holds LoRA adapters (train.lora) over the base weights its run wrote "
                        f"to {base}, which is missing: copy the checkpoints folder whole, base file included")
    check_shapes(str(base), read_shapes(base), {k: tuple(v.shape) for k, v in model.state_dict().items()})
    model.load_state_dict(read_state_dict(base))
    add_adapters(model, lora)
    load_model_weights(ckpt, model, ema=ema, trainable_only=True)
    if merge:
        merge_adapters(model)
