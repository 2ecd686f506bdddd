"""The config decided once, for every command: :func:`decide` takes the config as loaded, the world
size and the purpose, and returns a frozen copy with every value filled in or derived; the config it
was given is left as it was. After that a change is a new frozen copy (:func:`vltrain.types.revise`),
never a write, and what is saved (``config.yaml`` of a run, a checkpoint, an export) is the decided
config.

The pass, in order:

1. ``model.init``, or the model a command opens: a vltrain run, checkpoint or export gives its model
   section, preprocessing and tokenizer (:func:`_adopt_saved`); a Hugging Face folder or an OpenCLIP
   file its architecture and preprocessing (:func:`_adopt_imported`), read once and kept in
   :attr:`Decided.imported` for the door to load. A model opened to use rather than to train runs in
   fp32 unless ``train.precision`` is given (someone else's checkpoint: its numbers as they are); a
   vltrain one reads the tokenizer saved with its weights. A ``data.max_text_length`` above a CLIP
   checkpoint's context stretches its text position table (:meth:`Pretrained.stretched`): the
   decided ``model.arch`` has the longer table, which a resumed or reopened run rebuilds.
2. For training, the global batch: ``data.batch_size`` and ``train.accumulation`` for this world
   (:func:`~vltrain.compose.rules.resolve_global_batch`), its budgets checked at the resolved lengths.
3. Images at their own shape: ``data.patch_size`` is the architecture's, so that data code never
   needs a model (:func:`~vltrain.compose.rules.fit_native`).
4. For training, the objectives: those the architecture has no head for are set to 0,
   ``itm_negatives: auto`` becomes group or local, and the ITM group size is chosen (the config's,
   else the checkpoint the run resumes from, else the default).
5. For training, the distillation teacher (``model.teacher``): found, and its own config decided
   (purpose ``teacher``), before any model is built.

A model named by its Hub name (``hf-hub:ORG/NAME[@REVISION]``, :mod:`vltrain.checkpoint.hub`) is
saved pinned to the commit it resolved to: ``model.init`` and ``model.teacher.path`` of the decided
config read ``hf-hub:ORG/NAME@SHA``. A run that resumes reads the commit its checkpoint saved
(:func:`_pinned_by_resume`), unless the config pins another.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

from vltrain.checkpoint import hub
from vltrain.checkpoint.manager import STATE_FILE, resume_target
from vltrain.checkpoint.paths import CONFIG_FILE, IMPORTED, VLTRAIN_KINDS, Located, locate
from vltrain.compose.rules import decide_objectives, fit_native, itm_group, resolve_global_batch
from vltrain.config.job import JobConfig, load_config
from vltrain.data.image_input import image_layout
from vltrain.data.tokenizers import load_tokenizer
from vltrain.errors import ConfigError, UsageError, UserError
from vltrain.model.builder import has_decoder, has_fusion
from vltrain.model.config import ModelConfig
from vltrain.model.interop.pretrained import Pretrained, describe
from vltrain.types import freeze

log = logging.getLogger("vltrain")

PURPOSES = ("train", "eval", "embed", "caption", "export", "teacher")
"""What a config is decided for: a run, or a model opened to evaluate, embed, caption, export or
teach with (these take the model's config as it is, and decide no batch, objective or teacher)."""
PREPROCESSING_KEYS = ("image_size", "mean", "std", "resize", "interpolation", "max_text_length", "max_patches")
"""The ``data.*`` values ``model.init`` fills in from the checkpoint where the config sets none."""
TEXT_CLEAN = {"openclip": "clip", "openclip-coca": "clip", "hf-siglip2": "lower"}
"""``data.text_clean`` for checkpoints whose captions were cleaned before their tokenizer.json saw them."""


@dataclass(frozen=True)
class TeacherPlan:
    """``model.teacher`` located, with its own decided config (its preprocessing in ``cfg.data``),
    decided before anything is built."""

    decided: "Decided"
    precomputed: bool

    @property
    def located(self) -> Located:
        return self.decided.weights

    @property
    def cfg(self) -> JobConfig:
        return self.decided.cfg


@dataclass(frozen=True)
class Decided:
    """The frozen config, and what the pass found on its way: what the door loads, what to say."""

    cfg: JobConfig
    purpose: str
    weights: Located | None = None
    """Where the model's weights come from: the path a command opens, or a run's ``model.init``
    (None: a run that starts from fresh weights)."""
    imported: Pretrained | None = None
    """``weights`` of a Hugging Face folder or an OpenCLIP file, described (read once, here)."""
    batch: str = ""
    """A run's global batch, in words."""
    itm_source: str = ""
    """Where the ITM group size came from ("" when ITM draws no negatives by group)."""
    teacher: TeacherPlan | None = None
    """``model.teacher``, located, with its decided config."""


def decide(cfg: JobConfig, world_size: int = 1, purpose: str = "train", opening: Located | None = None) -> Decided:
    """``cfg`` decided for ``purpose`` on ``world_size`` ranks (the module's pass), frozen; ``opening``:
    the model a command opens (its config is ``cfg``, loaded by :func:`model_config`)."""
    if purpose not in PURPOSES:
        raise ValueError(f"purpose {purpose!r}: one of {', '.join(PURPOSES)}")
    cfg = copy.deepcopy(cfg)  # the pass writes its own copy, which it freezes
    if purpose == "train" and opening is None and hub.is_hub_name(cfg.model.init):
        cfg.model.init = _pinned_by_resume(cfg)
    weights = opening if opening is not None else (locate(cfg.model.init, role="model.init") if cfg.model.init
                                                  else None)
    if weights is not None and weights.pinned:
        cfg.model.init = weights.pinned  # the commit the name resolved to, saved with the run
    imported = None
    if weights is not None and weights.kind in IMPORTED:
        imported = _adopt_imported(cfg, weights)
        if purpose != "train" and not cfg.was_set("train.precision"):
            cfg.train.precision = "fp32"
    elif weights is not None and opening is None:
        _adopt_saved(cfg, weights)
    elif weights is not None and (saved := weights.saved_tokenizer()) is not None:
        cfg.data.tokenizer = str(saved)  # the copy saved with the weights, before data.tokenizer
    if purpose != "train":
        for stage in cfg.train.stages:  # a run's model sees images as its last stage saw them
            for key, value in stage.data().items():
                setattr(cfg.data, key, value)
        fit_native(cfg)
        return Decided(freeze(cfg), purpose, weights, imported)
    batch = resolve_global_batch(cfg, world_size)
    fit_native(cfg)
    decide_objectives(cfg)
    size, itm_source = itm_group(cfg.model.loss, cfg.data.batch_size, cfg.data.global_batch_size,
                                 _resumed_itm_group(cfg) if cfg.model.loss.itm_negatives == "group" else 0)
    cfg.model.loss.itm_group_size = size
    teacher = plan_teacher(cfg)
    if teacher is not None and teacher.located.pinned:
        cfg.model.teacher.path = teacher.located.pinned
    return Decided(freeze(cfg), purpose, weights, imported, batch, itm_source, teacher)


def model_config(found: Located, overrides: list[str] | None = None, purpose: str = "eval") -> Decided:
    """The decided config that rebuilds the model ``found`` holds, with ``overrides``: a run's or
    checkpoint's saved config (the run's when the checkpoint has none), an export's config.yaml, or
    ``model.init`` of an imported checkpoint."""
    overrides = list(overrides or [])
    if found.kind in IMPORTED:
        raw = load_config(None, [f"model.init={found.name}", *overrides])
    else:
        raw = load_config(found.config_file(), overrides)
    return decide(raw, 1, purpose, opening=found)


def _adopt_imported(cfg: JobConfig, found: Located) -> Pretrained:
    """``model.init`` of an imported checkpoint: its architecture (into ``model.arch``) and, for every
    preprocessing value the config does not set, the checkpoint's (its tokenizer, if ``data.tokenizer``
    is empty; SigLIP's objective, or a captioner's caption loss alone, if ``model.loss`` sets neither
    itc nor siglip). Returns the checkpoint, described."""
    mc = cfg.model
    if mc.text.hf_path:
        raise ConfigError("model.init and model.text.hf_path both give the text tower: set one of them")
    source = describe(found.path, found.kind, mc.preset if cfg.was_set("model.preset") else "", mc.quick_gelu)
    if cfg.was_set("data.max_text_length") and cfg.data.max_text_length > source.arch.text.max_length:
        source = source.stretched(cfg.data.max_text_length, mc.text.stretch_keep)  # Long-CLIP's longer table
    pp = source.preprocessing
    for key in PREPROCESSING_KEYS:
        if not cfg.was_set(f"data.{key}"):
            setattr(cfg.data, key, getattr(pp, key))
    if not cfg.data.tokenizer:
        if not pp.tokenizer:
            hint = (" OpenCLIP's own: `vltrain tokenizer from-openclip --out tok.json` writes it"
                    if source.kind.startswith("openclip") else "")
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


def _adopt_saved(cfg: JobConfig, found: Located) -> None:
    """``model.init`` of a vltrain run, checkpoint or export (a new run that starts from its weights,
    with a fresh optimizer and data order): every ``model.*`` key of its saved config (but the
    distillation teacher and its loss weights, which were that run's recipe) and the preprocessing the
    position embeddings depend on, where ``cfg`` sets none, and the tokenizer saved with the weights.
    ``model.init`` is then done with: the door loads the weights into the built model."""
    saved = load_config(found.config_file())
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


def describe_preprocessing(cfg: JobConfig, source: Pretrained) -> str:
    """The decided preprocessing, printed once when a run starts from ``model.init`` of an imported
    checkpoint."""
    d, text = cfg.data, source.arch.text
    padding = (f"fixed to {text.max_length} with id {text.pad_id} (the tower pads)" if text.pad_to_max_length
               else "to the batch's longest caption")
    lines = [
        f"model.init {source.path} ({source.kind}, architecture {source.arch_from})",
        f"  {image_layout(d).describe()} ({d.interpolation}), mean {d.mean}, std {d.std}",
        f"  text: tokenizer {d.tokenizer} "
        f"({'lower-cased' if load_tokenizer(d.tokenizer).lowercases() or d.text_clean == 'lower' else 'cased'}), "
        f"at most {d.max_text_length} tokens, padded {padding}",
        f"  objective: itc {cfg.model.loss.itc:g}, siglip {cfg.model.loss.siglip:g}"
        + (f", itm {cfg.model.loss.itm:g}" if has_fusion(cfg.model.architecture(), cfg.model.loss) else "")
        + (f", caption {cfg.model.loss.caption:g}" if has_decoder(cfg.model.architecture(), cfg.model.loss) else ""),
    ]
    return "\n".join(lines + [f"  note: {n}" for n in source.preprocessing.notes])


def plan_teacher(cfg: JobConfig) -> TeacherPlan | None:
    """The run's teacher, found and its config decided (nothing loaded); None without one."""
    t = cfg.model.teacher
    if not t.path:
        return None
    try:
        return locate_teacher(t.path, "model.teacher.path", t.precomputed)
    except ConfigError:
        raise
    except UsageError as e:  # no teacher there: the config's mistake
        raise ConfigError(f"model.teacher: the teacher cannot be opened: {e}") from None
    except UserError as e:  # a teacher that is there but cannot be read: `vltrain data teacher-embed`'s exit code too
        raise type(e)(f"model.teacher: the teacher cannot be opened: {e}") from None


def locate_teacher(path: str, role: str, precomputed: bool = False) -> TeacherPlan:
    """``path`` located and the config that rebuilds it decided (``role`` names it in errors). A
    teacher that takes images at their own shape (SigLIP 2's NaFlex) gets them so, one per row, padded
    to its ``data.max_patches``: :func:`vltrain.data.config.teacher_data`."""
    return TeacherPlan(model_config(locate(path, role=role), purpose="teacher"), precomputed)


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


def _pinned_by_resume(cfg: JobConfig) -> str:
    """``model.init`` of a Hub name, as a run that resumes reads it: the commit the checkpoint it
    resumes from saved, when that is a pin of the same repository and the config pins no commit
    itself; else as given."""
    asked = hub.parse(cfg.model.init, "model.init")
    if asked.is_commit:
        return cfg.model.init
    try:
        path = resume_target(cfg.train.resume, Path(cfg.run.dir) / cfg.checkpoint.folder)
        saved = load_config(path / CONFIG_FILE).model.init if path is not None else ""
    except (UserError, OSError):
        return cfg.model.init  # no checkpoint to read, or none readable: the checkpointer says which
    if not hub.is_hub_name(saved) or hub.parse(saved).repo != asked.repo or not hub.parse(saved).is_commit:
        return cfg.model.init
    log.info(f"model.init {cfg.model.init}: the commit the resumed checkpoint {path} saved, {saved}")
    return saved
