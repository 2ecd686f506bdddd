"""``model.init`` from a vltrain checkpoint or export: a new run (a new batch size, schedule or data)
that starts from another run's weights, with a fresh optimizer and data order.

The saved config gives what the weights need to load: every ``model.*`` key (but the distillation
teacher and its loss weights, which were that run's recipe) and the preprocessing
the position embeddings depend on, where this run's config does not set them, and the tokenizer
saved with the weights (:mod:`vltrain.compose.opening`'s rule). The weights are read by
:func:`vltrain.compose.opening.load_weights` once the model is built.
"""

from __future__ import annotations

import dataclasses

from vltrain.compose.opening import model_config
from vltrain.checkpoint.paths import VLTRAIN_KINDS, Located, locate
from vltrain.config.job import JobConfig
from vltrain.model.config import ModelConfig
from vltrain.compose.builders import PREPROCESSING_KEYS


def vltrain_model(init: str) -> Located | None:
    """What ``model.init`` names if vltrain wrote it (a run, a checkpoint, an export); None when it is
    empty or an imported checkpoint (:func:`vltrain.compose.builders.resolve_init` reads those)."""
    if not init:
        return None
    found = locate(init, role="model.init")
    return found if found.kind in VLTRAIN_KINDS else None


def adopt_saved_model(cfg: JobConfig, found: Located) -> None:
    """Fill ``cfg`` from the saved config where ``cfg`` sets nothing; ``model.init`` is then done
    with (the caller loads the weights into the built model)."""
    saved = model_config(found)
    distilling = {k: cfg.was_set(f"model.loss.{k}") for k in ("distill", "distill_sigmoid")}
    for f in dataclasses.fields(ModelConfig):
        empty_preset = f.name == "preset" and not cfg.model.preset  # '': the saved model's architecture
        if f.name not in ("init", "teacher") and (empty_preset or not cfg.was_set(f"model.{f.name}")):
            setattr(cfg.model, f.name, getattr(saved.model, f.name))
    for key, given in distilling.items():  # the saved run's teacher was its recipe, not the model's
        if not given:
            setattr(cfg.model.loss, key, 0.0)
    for key in PREPROCESSING_KEYS:
        if not cfg.was_set(f"data.{key}"):
            setattr(cfg.data, key, getattr(saved.data, key))
    tokenizer = found.saved_tokenizer() or saved.data.tokenizer
    if not cfg.data.tokenizer and tokenizer:
        cfg.data.tokenizer = str(tokenizer)
    cfg.model.init = ""
