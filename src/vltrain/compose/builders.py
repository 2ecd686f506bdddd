"""Builders shared by training, evaluation, export and the demo: the tokenizer, the model, the task
and the data loaders a config describes. Each is decided here once, so every command sees the same model
and the same data pipeline."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import torch

from vltrain.config.job import JobConfig
from vltrain.data.dataset import build_dataset, source_specs
from vltrain.data.loading.loader import TrainLoader, build_eval_loader, build_train_loader
from vltrain.data.schedule import budget
from vltrain.data.tokenizers import Tokenizer, load_tokenizer
from vltrain.errors import ConfigError, UserError
from vltrain.model import VLModel, build_model, hf_tokenizer_file
from vltrain.model.builder import has_decoder, has_fusion
from vltrain.model.config import LossConfig
from vltrain.model.interop.pretrained import Pretrained, load_pretrained, open_pretrained
from vltrain.model.presets import Architecture
from vltrain.objectives.scoring import Objectives
from vltrain.runtime.distributed import World
from vltrain.compose.task import Task


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


PREPROCESSING_KEYS = ("image_size", "mean", "std", "resize", "interpolation", "max_text_length", "max_patches")
"""The ``data.*`` values ``model.init`` fills in from the checkpoint where the config sets none."""
TEXT_CLEAN = {"openclip": "clip", "openclip-coca": "clip", "hf-siglip2": "lower"}
"""``data.text_clean`` for checkpoints whose captions were cleaned before their tokenizer.json saw them."""
log = logging.getLogger("vltrain")


def resolve_init(cfg: JobConfig) -> Pretrained | None:
    """``model.init``: the checkpoint's architecture (into ``model.arch``) and, for every preprocessing
    value the config does not set, the checkpoint's (its tokenizer, if ``data.tokenizer`` is empty;
    SigLIP's objective, or a captioner's caption loss alone, if ``model.loss`` sets neither itc nor
    siglip). Returns the opened checkpoint."""
    mc = cfg.model
    if not mc.init:
        return None
    if mc.text.hf_path:
        raise ConfigError("model.init and model.text.hf_path both give the text tower: set one of them")
    source = open_pretrained(mc.init, mc.preset if cfg.was_set("model.preset") else "", mc.quick_gelu)
    pp = source.preprocessing
    for key in PREPROCESSING_KEYS:
        if not cfg.was_set(f"data.{key}"):
            setattr(cfg.data, key, getattr(pp, key))
    if not cfg.data.tokenizer:
        if not pp.tokenizer:
            hint = (" OpenCLIP's own: `vltrain tokenizer from-openclip --out tok.json` writes it" if source.kind.startswith("openclip")
                    else "")
            raise ConfigError(f"model.init {mc.init}: no tokenizer.json beside it; set data.tokenizer to the "
                              "tokenizer the checkpoint was trained with (a tokenizer.json, e.g. from the matching "
                              f"Hugging Face folder).{hint}")
        cfg.data.tokenizer = pp.tokenizer
    if source.kind in TEXT_CLEAN and not cfg.was_set("data.text_clean"):
        cfg.data.text_clean = TEXT_CLEAN[source.kind]  # how the captions it trained on were cleaned
    if pp.objective != "itc" and not (cfg.was_set("model.loss.itc") or cfg.was_set("model.loss.siglip")):
        # SigLIP's sigmoid loss; a captioner (BLIP's) has no contrastive parts: its caption loss alone
        mc.loss.itc, mc.loss.siglip = 0.0, float(pp.objective == "siglip")
    mc.arch = source.arch.to_dict()
    if not source.arch_from.startswith("of model.preset"):
        mc.preset = ""  # the architecture is the checkpoint's alone (model.arch): no preset gave any of it
    return source


def describe_preprocessing(cfg: JobConfig, source: Pretrained) -> str:
    """The resolved preprocessing, printed once when a run starts from ``model.init``."""
    d, text = cfg.data, source.arch.text
    padding = (f"fixed to {text.max_length} with id {text.pad_id} (the tower pads)" if text.pad_to_max_length
               else "to the batch's longest caption")
    lines = [
        f"model.init {source.path} ({source.kind}, architecture {source.arch_from})",
        (f"  images: at their own shape, at most {d.max_patches} patches ({d.interpolation}), mean {d.mean}, "
         f"std {d.std}" if d.resize == "native" else
         f"  images: {d.image_size} px, resize {d.resize} ({d.interpolation}), mean {d.mean}, std {d.std}"),
        f"  text: tokenizer {d.tokenizer} "
        f"({'lower-cased' if load_tokenizer(d.tokenizer).lowercases() or d.text_clean == 'lower' else 'cased'}), "
        f"at most {d.max_text_length} tokens, padded {padding}",
        f"  objective: itc {cfg.model.loss.itc:g}, siglip {cfg.model.loss.siglip:g}"
        + (f", itm {cfg.model.loss.itm:g}" if has_fusion(cfg.model.architecture(), cfg.model.loss) else "")
        + (f", caption {cfg.model.loss.caption:g}" if has_decoder(cfg.model.architecture(), cfg.model.loss) else ""),
    ]
    return "\n".join(lines + [f"  note: {n}" for n in source.preprocessing.notes])


def build_model_for(cfg: JobConfig, tokenizer: Tokenizer, device: torch.device | str = "cpu",
                    load_init: bool = True) -> VLModel:
    """The (unwrapped) model a config describes, sized for the tokenizer and the data, on ``device``.

    With ``model.init`` (resolved by :func:`resolve_init`) the architecture and its vocabulary and
    positions are the checkpoint's, and its weights are loaded unless ``load_init`` is false (the
    caller loads a vltrain checkpoint over them)."""
    vocab_size, max_text_length, arch = tokenizer.vocab_size, cfg.data.max_text_length, None
    if cfg.model.init or cfg.model.arch:
        if not cfg.model.arch:
            raise ConfigError("model.init is set but not resolved: call vltrain.compose.builders.resolve_init(cfg) first")
        arch = Architecture.from_dict(cfg.model.arch)
        vocab_size, max_text_length = _check_fits_init(cfg, tokenizer, arch)
    model = build_model(
        cfg.model, vocab_size=vocab_size, pad_id=tokenizer.pad_id, mask_id=tokenizer.mask_id,
        image_size=cfg.data.image_size, max_text_length=max_text_length,
    )
    if model.decoder is not None and (tokenizer.cls_id is None or tokenizer.eos_id is None):
        raise UserError(f"data.tokenizer {cfg.data.tokenizer}: a captioning decoder predicts each caption from its "
                        "start token to its end token, and this tokenizer has no start ([CLS], <s>, "
                        "<|startoftext|>) or no end token ([SEP], </s>, <|endoftext|>); use one that has both, or "
                        "set model.loss.caption=0")
    if cfg.model.init and load_init:
        source = open_pretrained(cfg.model.init, quick_gelu=cfg.model.quick_gelu)
        source.arch = arch  # the resolved one (with model.preset's head counts)
        for note in load_pretrained(model, source):
            log.info("model.init: %s", note)
    return model.to(device)


def fit_native(cfg: JobConfig) -> None:
    """``data.resize: native``: the patch side the data cuts images into is the architecture's (so
    data code needs no model). The native settings that need the architecture, or a ``resize`` that
    ``model.init`` may give, are checked here and nowhere else; those the data alone decides, when
    the config is read (``DataConfig.validate``)."""
    data = cfg.data
    if data.resize != "native":
        if data.pack_images or data.patch_budget:
            key = "data.pack_images packs" if data.pack_images else "data.patch_budget counts the patches of"
            raise ConfigError(f"{key} images at their own shape: set data.resize native, or "
                              f"{key.split()[0]} {'false' if data.pack_images else '0'}")
        return
    arch = cfg.model.architecture()
    patch = arch.vision.patch_size
    if data.patch_size not in (0, patch):
        raise ConfigError(f"data.patch_size {data.patch_size} differs from the model's patch size {patch}; "
                          "leave it 0")
    data.patch_size = patch


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


def decide_objectives(cfg: JobConfig) -> None:
    """The objectives the run trains, in ``cfg``: those the architecture has no head for (ITM and MLM
    without a fusion encoder, captioning without a decoder) set to 0, so that a saved config says what
    the run trains, and refused where the user asked for them (given on the command line);
    ``itm_negatives: auto`` is group with ``data.global_batch_size`` (see :func:`itm_group`)."""
    loss, arch = cfg.model.loss, cfg.model.architecture()
    lacking = [n for n, part in HEADS.items() if getattr(arch, part) is None]
    asked = [n for n in lacking if getattr(loss, n) and cfg.asked(f"model.loss.{n}")]
    if asked:
        raise _no_head(cfg, asked)
    for name in lacking:
        setattr(loss, name, 0.0)
    if cfg.train.contrastive_accumulation == "gradcache" and not loss.contrastive:
        raise ConfigError("train.contrastive_accumulation: gradcache caches the contrastive loss's gradient, and no "
                          "contrastive objective is on (model.loss itc, siglip, distill); set it to none")
    if loss.itm_negatives == "auto":  # groups need micro-batches of one size: fixed batching
        loss.itm_negatives = "group" if cfg.data.global_batch_size and cfg.data.batching == "fixed" else "local"
    if loss.itm_negatives == "group" and cfg.data.batching == "budget":
        raise ConfigError("model.loss.itm_negatives: group needs data.batching: fixed (budget micro-batches differ "
                          "in size, so no group size divides them all); use local or global")


HEADS = {"caption": "decoder", "itm": "fusion", "mlm": "fusion"}
"""The objectives that need a part of the architecture, and that part."""


def _no_head(cfg: JobConfig, names: list[str]) -> ConfigError:
    """Weights asked for objectives whose heads the model has not: the run would silently train the rest."""
    from vltrain.model.presets import PRESETS

    heads = {"fusion": "a fusion encoder", "decoder": "a captioning decoder"}
    said = [f"model.loss.{n}={getattr(cfg.model.loss, n):g} needs {heads[HEADS[n]]}" for n in names]
    parts = {HEADS[n] for n in names}
    having = [p for p, make in PRESETS.items() if all(getattr(make(), part) is not None for part in parts)]
    model = cfg.model.preset or f"the model of {cfg.model.init}"
    return ConfigError(f"{'; '.join(said)}, which {model} has not: the run would train without "
                       f"{'it' if len(names) == 1 else 'them'}. Set {' '.join(f'model.loss.{n}=0' for n in names)}, "
                       f"or use a preset that has {'it' if len(parts) == 1 else 'both'} ({', '.join(having)})")


def build_task(cfg: JobConfig, model: VLModel) -> Task:
    """The model with the objectives of the decided ``model.loss`` (:func:`decide_objectives`)."""
    return Task(model, Objectives(cfg.model.loss, model.spec, cfg.model.vision))


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
