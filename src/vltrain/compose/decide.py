"""A run's config, decided once: every value that is filled in or derived is set here, in one pass,
before anything is built; the config is then frozen, saved as the run's ``config.yaml``, and is what
the run uses.

The pass, in order:

1. ``model.init``: a vltrain run, checkpoint or export gives its model section, preprocessing and
   tokenizer (:func:`~vltrain.checkpoint.init_from.adopt_saved_model`); a Hugging Face folder or an
   OpenCLIP file its architecture and preprocessing (:func:`~vltrain.compose.builders.resolve_init`).
2. The global batch: ``data.batch_size`` and ``train.accumulation`` for this world
   (:func:`~vltrain.compose.builders.resolve_global_batch`), its budgets checked at the resolved lengths.
3. Images at their own shape: ``data.patch_size`` is the architecture's, so that data code never
   needs a model (:func:`~vltrain.compose.builders.fit_native`).
4. The objectives: those the architecture has no head for are set to 0, ``itm_negatives: auto``
   becomes group or local, and the ITM group size is chosen (the config's, else the checkpoint the
   run resumes from, else the default).
5. The distillation teacher (``model.teacher``): found, and its preprocessing read
   (:func:`~vltrain.train.teacher.plan_teacher`), before any model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vltrain.checkpoint.init_from import adopt_saved_model, vltrain_model
from vltrain.checkpoint.manager import STATE_FILE, resume_target
from vltrain.checkpoint.paths import Located
from vltrain.config.job import JobConfig
from vltrain.errors import UserError
from vltrain.model.interop.pretrained import Pretrained
from vltrain.compose.builders import (decide_objectives, fit_native, itm_group, resolve_global_batch,
                                 resolve_init)
from vltrain.train.teacher import TeacherPlan, plan_teacher
from vltrain.types import freeze


@dataclass
class Resolved:
    """The frozen config, and what the pass found on its way, for the trainer to say and to load."""

    cfg: JobConfig
    batch: str
    """The global batch, in words."""
    itm_source: str
    """Where the ITM group size came from ("" when ITM draws no negatives by group)."""
    saved_init: Located | None = None
    """``model.init`` that vltrain wrote: its weights are loaded once the model is built."""
    imported_init: Pretrained | None = None
    """``model.init`` of a Hugging Face folder or an OpenCLIP file, opened."""
    teacher: TeacherPlan | None = None
    """``model.teacher``, located, with its preprocessing."""


def resolve_run(cfg: JobConfig, world_size: int) -> Resolved:
    """Decide ``cfg`` for a run on ``world_size`` ranks (the module's pass), then freeze it."""
    saved_init = vltrain_model(cfg.model.init)
    imported_init = None
    if saved_init is not None:
        adopt_saved_model(cfg, saved_init)
    else:
        imported_init = resolve_init(cfg)
    batch = resolve_global_batch(cfg, world_size)
    fit_native(cfg)
    decide_objectives(cfg)
    size, itm_source = itm_group(cfg.model.loss, cfg.data.batch_size, cfg.data.global_batch_size,
                                 _resumed_itm_group(cfg) if cfg.model.loss.itm_negatives == "group" else 0)
    cfg.model.loss.itm_group_size = size
    teacher = plan_teacher(cfg)
    freeze(cfg)
    return Resolved(cfg, batch, itm_source, saved_init, imported_init, teacher)


def _resumed_itm_group(cfg: JobConfig) -> int:
    """The ITM group size of the checkpoint ``train.resume`` restores (0: none, or it kept none).
    A checkpoint that cannot be read is said by the checkpointer, when it loads it."""
    try:
        path = resume_target(cfg.train.resume, Path(cfg.run.dir) / cfg.checkpoint.folder)
        if path is None:
            return 0
        state = json.loads((path / STATE_FILE).read_text())
        return int(state["states"]["trainer"].get("itm_group_size", 0))
    except (UserError, OSError, ValueError, KeyError, TypeError):
        return 0
