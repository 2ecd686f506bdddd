"""The run's stages in the loop (``train.stages``, :mod:`vltrain.config.stages`): before each step,
the stage that step is in; where it changes, the objectives of the new stage, and the EMA teacher
started from the student where a stage turns it on.

The stage of a step is a function of the step, so what happens at a boundary happens at the same
step whether the run went through it or was resumed on either side of it: a checkpoint written
at a stage's first step (the steps before it done) resumes into the crossing itself.
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from vltrain.config.job import JobConfig
from vltrain.config.stages import TEACHER_LOSSES, Stage, resolve, stage_at
from vltrain.objectives.scoring import Objectives
from vltrain.train.parallelize import task_of
from vltrain.train.resizing import fit_table
from vltrain.types import revise


def stage_objectives(cfg: JobConfig, spec, stage: Stage) -> Objectives:
    """The objectives of ``stage``: the decided ``model.loss`` with the stage's weights, and its patch
    dropout."""
    return Objectives(revise(cfg.model.loss, **stage.loss), spec,
                      revise(cfg.model.vision, patch_dropout=stage.patch_dropout), cfg.model.selfdist)


def switch_loader(loader, build: Callable[[], object]):
    """A stage changes the images: the loader ``build`` makes, at ``loader``'s data position (which
    stops its workers): the same samples in the same steps, laid out as the stage says."""
    state, elastic = loader.state_dict(), loader.elastic
    loader.close()
    new = build()
    new.elastic = elastic
    new.load_state_dict(state)
    return new


def describe(stage: Stage, before: Stage) -> str:
    """The log line of a crossing: the stage, its first step, and what changed."""
    said = [f"{k} {v:g}" for k, v in stage.loss.items() if before.loss.get(k) != v]
    parts = [f"loss weights {', '.join(said)}"] if said else []
    if stage.patch_dropout != before.patch_dropout:
        parts.append(f"patch dropout {stage.patch_dropout:g}")
    if stage.teacher != before.teacher:
        parts.append("the EMA teacher on, started from the student's weights" if stage.teacher
                     else "the EMA teacher off")
    if stage.data != before.data:
        parts.append("images " + ", ".join(f"{k} {v}" for k, v in stage.data.items() if before.data.get(k) != v))
    if stage.lr_stretch != before.lr_stretch:
        parts.append(f"the learning-rate schedule {stage.lr_stretch:g}x slower")
    return f"{stage.label} from step {stage.start + 1}: {'; '.join(parts) or 'nothing changes'}"


class Stages:
    """The resolved stages of a run and the one it is in; ``enter`` hands a new stage's objectives to
    the task and the step."""

    def __init__(self, cfg: JobConfig):
        tc = cfg.train
        self.cfg = cfg
        self.all = resolve(tc.stages, tc.max_steps, cfg.model.vision.patch_dropout, bool(tc.ema.decay))
        self.current = self.all[0]

    def with_data(self, stage: Stage) -> JobConfig:
        """The run's config with ``stage``'s images (``data.*``), for the loaders of that stage."""
        return revise(self.cfg, data=revise(self.cfg.data, **stage.data)) if stage.data else self.cfg

    def objective_names(self, spec) -> list[str]:
        """Every objective some stage trains, in a fixed order (the per-source meter's columns)."""
        names: dict[str, None] = {}
        for stage in self.all:
            names.update(dict.fromkeys(stage_objectives(self.cfg, spec, stage).loss_weights))
        return list(names)

    def at(self, step: int) -> tuple[Stage, bool]:
        """The stage of step ``step`` (0-based), and whether the step is its first (a crossing)."""
        stage = stage_at(self.all, step)
        return stage, stage.number > 0 and stage.start == step

    def fit(self, step: int, wrapped: nn.Module, step_fn, ema, optimizer) -> None:
        """The position table at the image size of step ``step``'s stage (a resumed run, before its
        checkpoint is read: the stage its last step trained in), :func:`vltrain.train.resizing.fit_table`."""
        stage = self.at(max(step, 0))[0]
        fit_table(wrapped, task_of(wrapped).model, self.with_data(stage).data.image_size, optimizer, ema, step_fn)

    def before_step(self, step: int, wrapped: nn.Module, step_fn, ema, optimizer) -> str | None:
        """Before step ``step``: where the stage changes, its objectives in ``task`` and ``step_fn``, and
        the weight average ``ema`` updated by the step only where the teacher is on; at a stage's
        first step, the EMA restarted from the student where the stage turns the teacher on, the
        optimizer's moments of SILC's and TIPS's heads started where the stage turns their losses on
        (the heads waited at a zero gradient), and the line that says the crossing (returned; None
        elsewhere)."""
        stage, crossing = self.at(step)
        if stage is not self.current:  # the table first: the stage's objectives read the model's patches
            self.fit(step, wrapped, step_fn, ema, optimizer)
            task = task_of(wrapped)
            self.enter(stage, task, step_fn)
            step_fn.ema = ema if stage.teacher else None
        if not crossing:
            return None
        before = self.all[stage.number - 1]
        if stage.teacher and not before.teacher:
            ema.restart()
        if any(stage.loss.get(k, 0) > 0 and not before.loss.get(k, 0) > 0 for k in TEACHER_LOSSES):
            for p in task.model.selfdist.parameters():
                optimizer.state.pop(p, None)
        return describe(stage, before)

    def enter(self, stage: Stage, task: nn.Module, step_fn) -> Objectives:
        """Make ``stage`` the current one: its objectives in ``task`` (the unwrapped
        :class:`~vltrain.compose.task.Task`) and in ``step_fn`` (the :class:`~vltrain.train.step.Step`)."""
        objectives = stage_objectives(self.cfg, task.model.spec, stage)
        task.objectives = objectives
        step_fn.objectives = objectives
        self.current = stage
        return objectives
