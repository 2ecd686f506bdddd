"""Training in stages (``train.stages``): one declared schedule instead of a run stopped and restarted
with other flags.

A run starts in stage 0, the config as given; each entry of ``train.stages`` starts a stage at a step
(``at: 800``) or a fraction of ``train.max_steps`` (``at: 0.8``), and changes some of what the run
trains from there on. What an entry does not set carries over from the stage before it. An entry may
set:

- ``loss``: objective weights (``model.loss`` names: ``siglip: 1.0``, ``referring: 0.5`` ...);
- ``patch_dropout``: the share of each image's patches dropped (``model.vision.patch_dropout``);
- ``teacher``: the EMA of the student as a teacher (``train.ema``), on or off. Where it comes on,
  the average starts again from the student's weights of that step (SigLIP 2: "initialized from
  the student at that point"); it averages only in the stages where it is on;
- ``image_size``: square images of another size (``data.image_size``; SigLIP 2's fixed-resolution
  variants at 95%): the vision tower's position table is resized to it at the crossing (bilinear,
  as images at their own shape resize it), and the loaders are built again as below;
- ``resize``, ``max_patches``, ``max_patches_choices``: the images' layout (``data.*``), e.g. SigLIP 2's
  NaFlex stage: ``resize: native`` with a sequence length drawn per step. The loader (and the
  evaluation's) is built again at the crossing and goes on from the same data position; the
  position table is resized to each image's grid as native images always are. A model opened for
  evaluation or export later sees the images as the last stage did;
- ``lr_stretch``: the learning-rate schedule runs this many times slower from the stage's start
  (SigLIP 2's NaFlex stage stretches the last 10% of its schedule 3.75x): the schedule is a
  function of schedule time, which advances 1 / lr_stretch per step in the stage, and reaches its
  end at ``train.max_steps`` (:class:`vltrain.train.optim.WarmupCosine`).

Which stage a step is in is a function of the step alone, so a resumed run is in the right stage
by construction, and every rank and every split of the global batch agrees. The list is checked as
a whole when the config is loaded (:func:`check_stages`): a fraction over 1, stages out of order or
past the run, an unknown loss name, a teacher's loss before the teacher: one line naming the stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional, Union

from vltrain.errors import ConfigError
from vltrain.model.config import LossConfig
from vltrain.types import Settings

TEACHER_LOSSES = ("silc", "tips")
"""The objectives that read the EMA teacher: on only in a stage where the teacher is."""
FREE_WEIGHTS = ("itc", "siglip")
"""Weights a stage may turn on and off: they read the embeddings alone, no head of their own."""
HEADED_WEIGHTS = ("itm", "mlm", "text_mlm", "image_mim", "caption", "referring", "grounded_caption", "distill",
                  "distill_sigmoid")
"""Weights a stage may change but not turn on or off: the model has a head (or a teacher) for them
only when stage 0 has them on, and every head it has takes part in every step."""


@dataclass
class StageSettings(Settings):
    """One entry of ``train.stages``: where it starts and what it changes from there on."""

    name: str = ""
    """What the log line and the errors call it (empty: "stage N", N from 1)."""
    at: Union[int, float] = 0
    """Where it starts: a step (an integer, >= 1) or a fraction of train.max_steps (0 < at < 1)."""
    loss: dict[str, float] = field(default_factory=dict)
    """Objective weights from here on, by model.loss name (others carry over)."""
    patch_dropout: Optional[float] = None
    """model.vision.patch_dropout from here on (unset: carried over)."""
    teacher: Optional[bool] = None
    """The EMA teacher (train.ema) on or off from here on (unset: carried over; stage 0: off when a
    stage turns it on, else as train.ema says)."""
    lr_stretch: Optional[float] = None
    """From here on the learning-rate schedule advances 1 / lr_stretch of a step per step (1: as
    declared; unset: carried over)."""
    image_size: Optional[int] = None
    """data.image_size from here on: the position table resized to it at the crossing (unset: carried over)."""
    resize: Optional[Literal["crop", "squash", "native"]] = None
    """data.resize from here on: crop | squash | native (unset: carried over)."""
    max_patches: Optional[int] = None
    """data.max_patches from here on (images at their own shape; unset: carried over)."""
    max_patches_choices: Optional[list[int]] = None
    """data.max_patches_choices from here on: each step's sequence length drawn from these (NaFlex)."""

    def data(self) -> dict:
        """The data settings this entry sets."""
        return {k: getattr(self, k) for k in DATA_KEYS if getattr(self, k) is not None}

    def label(self, number: int) -> str:
        return f"stage {number} ({self.name})" if self.name else f"stage {number}"


@dataclass(frozen=True)
class Stage:
    """A stage resolved against the run: its number (0: the config as given), its first step
    (0-based: the steps done before it), and what holds in it, the carried-over values included."""

    number: int
    start: int
    label: str
    loss: dict[str, float]
    """Every weight that a stage has set so far (the others are the config's)."""
    patch_dropout: float
    teacher: bool
    lr_stretch: float
    data: dict = field(default_factory=dict)
    """Every data setting that a stage has set so far (``resize``, ``max_patches``, ``max_patches_choices``)."""


DATA_KEYS = ("image_size", "resize", "max_patches", "max_patches_choices")
"""What of ``data`` a stage may set: the images' layout."""


def start_step(at: Union[int, float], max_steps: int) -> int:
    """The first step of a stage declared ``at`` (0-based: the optimizer steps done before it)."""
    return int(round(at * max_steps)) if isinstance(at, float) else int(at)


def check_stages(stages: list[StageSettings], max_steps: int, loss: LossConfig | None = None) -> None:
    """Refuse a list that contradicts itself, naming the stage: ``at`` not a step in (0, max_steps)
    or a fraction in (0, 1), stages out of order, an unknown loss name or a negative weight, a
    patch dropout outside [0, 1), a stretch below 1, a teacher's loss on while the teacher is off."""
    loss = loss or LossConfig()
    previous, teacher = 0, False
    on = {k for k in TEACHER_LOSSES if getattr(loss, k, 0.0) > 0}
    if on:
        raise ConfigError(f"model.loss.{sorted(on)[0]} reads the EMA teacher, which no stage has turned on at step 0: "
                          "set it in the train.stages entry that turns the teacher on (teacher: true)")
    for i, s in enumerate(stages, 1):
        label = f"train.stages {s.label(i)}"
        if isinstance(s.at, float) and not 0.0 < s.at < 1.0:
            raise ConfigError(f"{label}: at={s.at} is a fraction of train.max_steps and must lie in (0, 1); "
                              "give a step as an integer")
        start = start_step(s.at, max_steps)
        if not 0 < start < max_steps:
            raise ConfigError(f"{label}: starts at step {start}, outside the run's steps 1 to {max_steps - 1}")
        if start <= previous:
            raise ConfigError(f"{label}: starts at step {start}, not after the stage before it (step {previous}); "
                              "list the stages in order")
        previous = start
        _check_values(label, s, loss)
        teacher = s.teacher if s.teacher is not None else teacher
        on = (on | {k for k, v in s.loss.items() if v > 0}) - {k for k, v in s.loss.items() if v == 0}
        early = sorted(on & set(TEACHER_LOSSES))
        if early and not teacher:
            raise ConfigError(f"{label}: loss {early[0]} reads the EMA teacher, which is off in this stage; turn it "
                              "on here or before (teacher: true)")


def _check_values(label: str, s: StageSettings, loss: LossConfig) -> None:
    names = [n for n in (*FREE_WEIGHTS, *HEADED_WEIGHTS, *TEACHER_LOSSES) if hasattr(loss, n)]
    stray = sorted(set(s.loss) - set(names))
    if stray:
        raise ConfigError(f"{label}: loss names {stray[0]!r}, not a weight of model.loss (one of {', '.join(names)})")
    switched = [k for k, v in s.loss.items() if k in HEADED_WEIGHTS and (v > 0) != (getattr(loss, k) > 0)]
    if switched:
        k = switched[0]
        raise ConfigError(f"{label}: loss {k}={s.loss[k]:g} turns an objective {'on' if s.loss[k] else 'off'} that "
                          f"is {'off' if s.loss[k] else 'on'} in stage 0 (model.loss.{k}={getattr(loss, k):g}); a "
                          "stage changes the weight of a head's objective, it does not add or remove the head")
    negative = [k for k, v in s.loss.items() if v < 0 or not math.isfinite(v)]
    if negative:
        raise ConfigError(f"{label}: loss {negative[0]}={s.loss[negative[0]]} must be a finite weight >= 0")
    if s.patch_dropout is not None and not 0.0 <= s.patch_dropout < 1.0:
        raise ConfigError(f"{label}: patch_dropout={s.patch_dropout} must lie in [0, 1)")
    if s.lr_stretch is not None and not s.lr_stretch >= 1.0:
        raise ConfigError(f"{label}: lr_stretch={s.lr_stretch} must be >= 1 (1: the schedule as declared)")


def resolve(stages: list[StageSettings], max_steps: int, patch_dropout: float, ema_on: bool) -> list[Stage]:
    """Stage 0 and the declared ones, each with the values that hold in it (carried over where an
    entry sets none). ``ema_on``: whether ``train.ema`` is on; the teacher is off in stage 0 when a
    stage turns it on, else it is on throughout as ``train.ema`` says."""
    turned_on = any(s.teacher for s in stages)
    current = Stage(0, 0, "stage 0", {}, patch_dropout, ema_on and not turned_on, 1.0)
    out = [current]
    for i, s in enumerate(stages, 1):
        current = Stage(
            i, start_step(s.at, max_steps), s.label(i), {**current.loss, **s.loss},
            current.patch_dropout if s.patch_dropout is None else s.patch_dropout,
            current.teacher if s.teacher is None else s.teacher,
            current.lr_stretch if s.lr_stretch is None else s.lr_stretch,
            {**current.data, **s.data()},
        )
        out.append(current)
    return out


def stage_at(stages: list[Stage], step: int) -> Stage:
    """The stage of step ``step`` (0-based: the steps done before it)."""
    found = stages[0]
    for s in stages[1:]:
        if s.start <= step:
            found = s
    return found


def stretches(stages: list[Stage]) -> tuple[tuple[int, float], ...]:
    """(first step, lr_stretch) of each stage after the first, for the schedule
    (:class:`vltrain.train.optim.WarmupCosine`); empty when no stage stretches it, so that a run
    without stretches computes its schedule exactly as before stages existed."""
    if all(s.lr_stretch == 1.0 for s in stages):
        return ()
    return tuple((s.start, s.lr_stretch) for s in stages[1:])
