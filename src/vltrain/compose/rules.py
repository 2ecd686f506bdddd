"""The rules the decide pass (:mod:`vltrain.compose.decide`) applies to a run's config once its
model is known: the patch side of images at their own shape, the objectives the architecture has heads
for, the global batch split over this world, and the ITM group. Each reads the config being decided
and writes only that copy, before it is frozen; the describing functions say what was decided."""

from __future__ import annotations

import dataclasses
import math

from vltrain.config.job import JobConfig
from vltrain.config.stages import TEACHER_LOSSES
from vltrain.data.schedule import budget
from vltrain.errors import ConfigError
from vltrain.model.config import LossConfig
from vltrain.objectives.scoring import Objectives


def fit_native(cfg: JobConfig) -> None:
    """``data.resize: native``: the patch side the data cuts images into is the architecture's (so
    data code needs no model). The native settings that need the architecture, or a ``resize`` that
    ``model.init`` may give, are checked here and nowhere else; those the data alone decides, when
    the config is read (``DataConfig.validate``)."""
    data = cfg.data
    staged = [dataclasses.replace(data, **settings) for _, settings in cfg.staged_data()]
    if not any(d.at_own_shape() for d in (data, *staged)):
        return  # (a stage that turns to native images cuts them at the same side)
    arch = cfg.model.architecture()
    patch = arch.vision.patch_size
    if data.patch_size not in (0, patch):
        raise ConfigError(f"data.patch_size {data.patch_size} differs from the model's patch size {patch}; "
                          "leave it 0")
    data.patch_size = patch


def decide_objectives(cfg: JobConfig) -> None:
    """The objectives the run trains, in ``cfg``: those the architecture has no head for (ITM and MLM
    without a fusion encoder, captioning without a decoder) set to 0, so that a saved config says what
    the run trains, and refused where the user asked for them (given on the command line);
    ``itm_negatives: auto`` is group with ``data.global_batch_size`` (see :func:`itm_group`)."""
    loss, arch = cfg.model.loss, cfg.model.architecture()
    lacking = [n for n, part in HEADS.items() if not _has(arch, part)]
    asked = [n for n in lacking if getattr(loss, n) and cfg.asked(f"model.loss.{n}")]
    if asked:
        raise _no_head(cfg, asked)
    for name in lacking:
        setattr(loss, name, 0.0)
    if cfg.train.contrastive_accumulation == "gradcache" and not loss.contrastive:
        raise ConfigError("train.contrastive_accumulation: gradcache caches the contrastive loss's gradient, and no "
                          "contrastive objective is on (model.loss itc, siglip, distill); set it to none")
    _decide_selfdist(cfg)
    _check_stage_sizes(cfg)
    if loss.itm_negatives == "auto":  # groups need micro-batches of one size: fixed batching
        loss.itm_negatives = "group" if cfg.data.global_batch_size and cfg.data.batching == "fixed" else "local"
    if loss.itm_negatives == "group" and cfg.data.batching == "budget":
        raise ConfigError("model.loss.itm_negatives: group needs data.batching: fixed (budget micro-batches differ "
                          "in size, so no group size divides them all); use local or global")


def _decide_selfdist(cfg: JobConfig) -> None:
    """SILC's and TIPS's heads, where a stage turns either loss on (``model.selfdist.heads``)."""
    turned_on = {k for s in cfg.train.stages for k, v in s.loss.items() if k in TEACHER_LOSSES and v > 0}
    cfg.model.selfdist.heads = bool(turned_on)
    if "tips" in turned_on and cfg.model.architecture().vision.pooling == "attn_pool":
        raise ConfigError("model.loss.tips predicts the teacher's patch tokens, and an attentional pooler's tokens "
                          "are not patches: leave tips off in train.stages (silc works)")


def _check_stage_sizes(cfg: JobConfig) -> None:
    """A stage's square image size is a whole number of the model's patches."""
    patch = cfg.model.architecture().vision.patch_size
    for i, s in enumerate(cfg.train.stages, 1):
        if s.image_size is not None and s.image_size % patch:
            raise ConfigError(f"train.stages {s.label(i)}: image_size {s.image_size} is not a whole number of the "
                              f"model's {patch}-pixel patches; give a multiple of {patch}")


HEADS = {"caption": "decoder", "itm": "fusion", "mlm": "fusion", "referring": "locca", "grounded_caption": "locca"}
"""The objectives that need a part of the architecture, and that part (locca: a LocCa decoder)."""


def _has(arch, part: str) -> bool:
    if part == "locca":
        return arch.decoder is not None and arch.decoder.standalone
    return getattr(arch, part) is not None


def _no_head(cfg: JobConfig, names: list[str]) -> ConfigError:
    """Weights asked for objectives whose heads the model has not: the run would silently train the rest."""
    from vltrain.model.presets import PRESETS

    heads = {"fusion": "a fusion encoder", "decoder": "a captioning decoder", "locca": "a LocCa decoder"}
    said = [f"model.loss.{n}={getattr(cfg.model.loss, n):g} needs {heads[HEADS[n]]}" for n in names]
    parts = {HEADS[n] for n in names}
    having = [p for p, make in PRESETS.items() if all(_has(make(), part) for part in parts)]
    model = cfg.model.preset or f"the model of {cfg.model.init}"
    return ConfigError(f"{'; '.join(said)}, which {model} has not: the run would train without "
                       f"{'it' if len(names) == 1 else 'them'}. Set {' '.join(f'model.loss.{n}=0' for n in names)}, "
                       f"or use a preset that has {'it' if len(parts) == 1 else 'both'} ({', '.join(having)})")


ITM_GROUP_MAX = 64
"""The largest automatic ITM group: ALBEF's per-GPU batch, from which it drew its negatives."""


def default_itm_group(rows: int) -> int:
    """The ITM group size of a step of ``rows`` rows when none is configured: its largest divisor up
    to about the square root of ``rows`` (and :data:`ITM_GROUP_MAX`). Group size and the number of
    micro-batches a step can be cut into (up to ``rows`` / size, each a multiple of the group)
    grow together: 16 rows give groups of 4 for up to 4 micro-batches, 256 groups of 16 for up
    to 16, 4,096 groups of 64 for up to 64. A prime ``rows`` has no such divisor above 1: then its
    smallest one (one micro-batch only)."""
    cap = min(ITM_GROUP_MAX, max(2, math.isqrt(rows)))
    fits = [d for d in range(2, cap + 1) if rows % d == 0]
    return max(fits) if fits else min(d for d in range(2, rows + 1) if rows % d == 0)


def itm_group(loss: LossConfig, micro: int, global_batch: int = 0, saved: int = 0) -> tuple[int, str]:
    """The ITM group size for micro-batches of ``micro`` rows, and where it came from ("" when the
    run draws no ITM negatives by group: the size is then the config's, unused).

    The configured size (``model.loss.itm_group_size``), else a resumed run's (``saved``), else
    the default of a step of ``global_batch`` rows (:func:`default_itm_group`): the same on any
    number of ranks. Without a global batch the step depends on the split anyway, and the default
    is the micro-batch's largest divisor up to 64. A size that does not divide ``micro`` is
    refused, since a group cut by a micro-batch boundary would change with the split."""
    configured = loss.itm_group_size
    if loss.itm <= 0 or loss.itm_negatives != "group":
        return configured, ""
    fits = [d for d in range(1, micro + 1) if micro % d == 0]
    if configured:
        size, said = configured, "model.loss.itm_group_size"
    elif saved:
        size, said = saved, "the checkpoint's"
    elif global_batch:
        size, said = default_itm_group(global_batch), f"the default for a global batch of {global_batch}"
    else:
        size, said = max(d for d in fits if d <= ITM_GROUP_MAX), f"the default for micro-batches of {micro}"
    if micro % size:
        if global_batch and not (configured or saved):
            raise ConfigError(
                f"ITM draws its negatives from groups of {size} rows ({said}), which do not divide this run's "
                f"micro-batches of {micro} rows: split a step of {global_batch} rows into at most "
                f"{global_batch // size} micro-batches (ranks x accumulation, data.micro_batch_size a multiple "
                f"of {size}), or set model.loss.itm_group_size to one of {fits} (another group size changes the "
                "run, so use it on every world size)")
        where = "model.loss.itm_group_size" if configured else "the checkpoint's ITM group size"
        raise ConfigError(f"{where} {size} does not divide the micro-batch of {micro} rows: ITM groups must not "
                          f"straddle micro-batches. Use a data.micro_batch_size that is a multiple of {size}, or "
                          f"model.loss.itm_group_size set to one of {fits} (another group size changes the run)")
    return size, said


def describe_itm(objectives: Objectives, global_batch: bool, source: str = "") -> str | None:
    """One log line on where ITM draws its negatives, and whether that ties the run to its split;
    ``source``: where the group size came from (:func:`itm_group`)."""
    if "itm" not in objectives.loss_weights:
        return None
    if objectives.itm_negatives == "group":
        return (f"ITM negatives from groups of {objectives.itm_group_size} consecutive rows of the global batch "
                f"({source + ': ' if source else ''}the same on any number of ranks)")
    pool = "each rank's micro-batch" if objectives.itm_negatives == "local" else "every rank's micro-batch"
    return (f"ITM negatives from {pool} (model.loss.itm_negatives: {objectives.itm_negatives})"
            + (": the ITM loss depends on the split; itm_negatives: group keeps it" if global_batch else ""))


def resolve_global_batch(cfg: JobConfig, world_size: int) -> str:
    """Set ``data.batch_size`` and ``train.accumulation`` from ``data.global_batch_size`` for this
    world (gradcache for the contrastive loss when a step takes several micro-batches); what the
    step is, in words. Refuses a global batch that does not split evenly, naming what would."""
    data, tc = cfg.data, cfg.train
    g, w = data.global_batch_size, world_size
    if not g and tc.accumulation > 1 and data.max_patches_choices:
        raise ConfigError(f"data.max_patches_choices draws one patch budget per step, and train.accumulation "
                          f"{tc.accumulation} without data.global_batch_size lets a step span two epochs; set "
                          "data.global_batch_size (steps of whole global batches) or train.accumulation 1")
    if not g:
        return (f"global batch {data.batch_size * tc.accumulation * w} = data.batch_size {data.batch_size} x "
                f"train.accumulation {tc.accumulation} x {w} rank(s): tied to the world size (set "
                "data.global_batch_size to train and resume the same batches on any number of ranks)")
    if g % w:
        raise ConfigError(f"data.global_batch_size={g} does not split among {w} ranks; use a multiple of {w} "
                          f"(e.g. {g - g % w or w} or {g + w - g % w})")
    micro = data.micro_batch_size or g // w
    if (g // w) % micro:
        fits = [m for m in range(1, g // w + 1) if (g // w) % m == 0]
        raise ConfigError(f"data.micro_batch_size={micro} does not divide the {g // w} rows each of {w} ranks "
                          f"takes per step (data.global_batch_size={g}); use one of {fits}")
    data.batch_size, tc.accumulation = micro, g // (w * micro)
    cached = tc.accumulation > 1 and cfg.model.loss.contrastive
    if cached:
        tc.contrastive_accumulation = "gradcache"  # the contrastive loss still sees all g rows
    said = (f"global batch {g} = {w} rank(s) x {tc.accumulation} micro-batch(es) x {micro} rows"
            + (" (gradcache)" if cached else ""))
    if data.batching != "budget":
        return said
    least = budget.min_step_rows(g)
    if g // micro > least:
        fits = [m for m in range(-(-g // least), g // w + 1) if (g // w) % m == 0]
        raise ConfigError(f"with data.batching: budget a step holds at least {least} rows (a quarter of "
                          f"data.global_batch_size={g}), and each of its {g // micro} micro-batches needs one: "
                          f"use a data.micro_batch_size from {fits}")
    resolved = data.resolve()
    budget.check_step_budgets(g, resolved.token_budget, resolved.image_budget, data.max_text_length,
                              resolved.pad_multiple, resolved.patch_budget, data.max_patches)
    patches = f" and {resolved.patch_budget} patches" if resolved.patch_budget else ""
    return (said.replace(f"x {micro} rows", f"x at most {micro} rows")
            + f"; budget steps of {least} to {g} rows, {resolved.token_budget} text positions, "
            f"{resolved.image_budget} images{patches}")
