"""What a path is: the one place that decides what a user named.

:func:`locate` tells the kinds of model vltrain opens apart: a run folder, a checkpoint (a
``step-N`` folder, or a ``checkpoints`` folder: its newest), an export (``vltrain export``), a
Hugging Face CLIPModel / SiglipModel / Siglip2Model / BLIP folder, an OpenCLIP CLIP or CoCa checkpoint
(the imported kinds, named by :func:`vltrain.model.interop.pretrained.imported_kind`), or any of the
imported kinds by its Hub name, ``hf-hub:ORG/NAME[@REVISION]`` (:mod:`vltrain.checkpoint.hub`
resolves it to a folder of the Hugging Face cache, which is then opened as any folder). Opening
(:mod:`vltrain.compose.opening`), the checkpointer's resume, ``model.init`` and the teacher all ask
it, so that "what is this path" has one answer. It reads configs and tensor names, never weights.

The layouts it reads::

    RUN/config.yaml                 a run: its config (checkpoint.folder names its checkpoints)
    RUN/checkpoints/step-N/         a checkpoint: state.json, .metadata, config.yaml, tokenizer.json
    RUN/checkpoints/latest          the name of the newest complete checkpoint
    EXPORT/{model.safetensors, tokenizer.json, config.yaml}
    HF/config.json                  (and no config.yaml)
    FILE.{pt,pth,bin,safetensors}   an OpenCLIP checkpoint
    OPENCLIP/open_clip_config.json  an OpenCLIP model folder (and open_clip_model.safetensors, ...)
    hf-hub:ORG/NAME[@REVISION]      either of the last three, on the Hugging Face Hub
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from pathlib import Path

from vltrain.checkpoint import hub
from vltrain.checkpoint.integrity import damage
from vltrain.config.job import load_config
from vltrain.errors import UsageError, UserError
from vltrain.model.interop.pretrained import CHECKPOINT_SUFFIXES, IMPORTED_KINDS, imported_kind

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
CONFIG_FILE = "config.yaml"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"
"""An export's weights."""
HF_CONFIG = "config.json"
OPENCLIP_CONFIG = "open_clip_config.json"
LATEST_FILE = "latest"
LORA_BASE_FILE = "lora-base.safetensors"
"""In a LoRA run's checkpoints folder: the frozen weights under its adapters, written once (each
checkpoint holds the adapters alone)."""
DEFAULT_FOLDER = "checkpoints"
_STEP_DIR = re.compile(r"^step-(\d+)$")

RUN, CHECKPOINT, EXPORT, HF, OPENCLIP = "run", "checkpoint", "export", "hf", "openclip"
"""``HF`` and ``OPENCLIP``: the families of the imported kinds (:data:`IMPORTED`), as :attr:`Located.family` says."""
KINDS = {
    RUN: "a run folder (config.yaml and its checkpoints)",
    CHECKPOINT: f"a checkpoint (a step-N folder with {STATE_FILE}, or a checkpoints folder)",
    EXPORT: f"an exported model (vltrain export: {WEIGHTS_FILE}, {TOKENIZER_FILE}, {CONFIG_FILE})",
    HF: f"a Hugging Face CLIPModel, SiglipModel, Siglip2Model or BLIP folder ({HF_CONFIG})",
    OPENCLIP: f"an OpenCLIP checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)}) or model folder ({OPENCLIP_CONFIG})",
}
HUB_KIND = "either of the last two by its Hugging Face Hub name (hf-hub:ORG/NAME[@REVISION])"
VLTRAIN_KINDS = (RUN, CHECKPOINT, EXPORT)
"""Kinds vltrain wrote: their config and tokenizer are saved beside the weights."""
IMPORTED = IMPORTED_KINDS
"""Kinds someone else saved (hf-clip, hf-siglip, hf-siglip2, hf-blip, openclip, openclip-coca): their
architecture and preprocessing come from the checkpoint."""


@dataclass(frozen=True)
class Located:
    """What a path is, and where its parts are."""

    path: Path
    kind: str
    checkpoint: Path | None = None
    """RUN and CHECKPOINT: the ``step-N`` folder that holds the weights."""
    pinned: str = ""
    """A model named on the Hub: its name pinned to the commit it resolved to (``hf-hub:ORG/NAME@SHA``),
    which the decided config saves in place of the name given; ``path`` is that commit's cached folder."""

    @property
    def name(self) -> str:
        """How a config names it: the pinned Hub name, else the path."""
        return self.pinned or str(self.path)

    @property
    def family(self) -> str:
        """The kind, with the imported ones by who saved them: ``hf``, ``openclip``, or :attr:`kind`."""
        return self.kind.split("-")[0] if self.kind in IMPORTED else self.kind

    @property
    def weights(self) -> Path:
        """The checkpoint folder, the export's ``model.safetensors``, or the imported path."""
        if self.checkpoint is not None:
            return self.checkpoint
        return self.path / WEIGHTS_FILE if self.kind == EXPORT else self.path

    def config_file(self) -> Path | None:
        """The vltrain config saved with the weights: the checkpoint's own copy, else the run's."""
        if self.kind not in VLTRAIN_KINDS:
            return None
        candidates = [self.weights / CONFIG_FILE] if self.kind != EXPORT else []
        candidates.append(self.path / CONFIG_FILE)
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            raise UserError(f"{self.weights} has no {CONFIG_FILE}: the model it holds cannot be rebuilt")
        return found

    def saved_tokenizer(self) -> Path | None:
        """The tokenizer saved with the weights (a checkpoint's or an export's copy), if there is one."""
        if self.kind not in VLTRAIN_KINDS:
            return None
        folder = self.path if self.kind == EXPORT else self.weights
        return folder / TOKENIZER_FILE if (folder / TOKENIZER_FILE).is_file() else None


def accepted() -> str:
    return "give " + ", ".join([*KINDS.values(), HUB_KIND])


def locate(path: str | Path, role: str = "") -> Located:
    """What ``path`` is (``role``, e.g. "model.init", heads the message when it is none of them). A Hub
    name is resolved first (:func:`vltrain.checkpoint.hub.resolve`); what the cache holds for it is
    located as any folder."""
    if hub.is_hub_name(path):
        snapshot = hub.resolve(str(path), role)
        return replace(locate(snapshot.folder, role), pinned=snapshot.pinned)
    p = Path(path).expanduser()
    name = f"{role} {p}" if role else str(p)
    if p.is_file():
        if p.suffix in CHECKPOINT_SUFFIXES:
            return Located(p, imported_kind(p))
        raise UsageError(f"{name} is a file but not a checkpoint file; {accepted()}")
    if not p.is_dir():
        raise UsageError(f"{name} does not exist; {accepted()}")
    if is_complete(p):
        if (wrong := damage(p)) is not None:
            raise UserError(f"checkpoint {p} is damaged ({wrong}); name an intact one, or the run folder for "
                            "its newest intact checkpoint")
        return Located(p, CHECKPOINT, p)
    if all((p / f).is_file() for f in (WEIGHTS_FILE, TOKENIZER_FILE, CONFIG_FILE)):
        return Located(p, EXPORT)
    if (p / HF_CONFIG).is_file() and not (p / CONFIG_FILE).is_file() or (p / OPENCLIP_CONFIG).is_file():
        return Located(p, imported_kind(p))
    if (p / CONFIG_FILE).is_file():
        folder = p / load_config(p / CONFIG_FILE).checkpoint.folder
        return Located(p, RUN, _newest(folder, name))
    for folder, kind in ((p, CHECKPOINT), (p / DEFAULT_FOLDER, RUN)):  # a run folder without its config
        found = latest_checkpoint(folder)
        if found is not None:
            return Located(p, kind, found)
    raise UsageError(f"{name} holds no complete checkpoint and no model; {accepted()}")


def _newest(folder: Path, name: str) -> Path:
    found = latest_checkpoint(folder)
    if found is None:
        raise UsageError(f"{name} is a run folder, but {folder} holds no complete checkpoint (a step-N folder "
                        f"with {STATE_FILE}): the run saved none yet")
    return found


def find_checkpoint(path: str | Path) -> Path:
    """The vltrain checkpoint ``path`` names: a run's newest, a checkpoints folder's newest, or itself."""
    found = locate(path)
    if found.checkpoint is None:
        raise UsageError(f"{found.path} is {KINDS[found.family]}, not a vltrain run or checkpoint")
    return found.checkpoint


def step_of(path: Path) -> int | None:
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def is_complete(path: Path) -> bool:
    return step_of(path) is not None and (path / STATE_FILE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete ``step-N`` folders under ``folder``, oldest first."""
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: step_of(p))


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint ``latest`` names if it is complete and intact, else the newest one that is. A
    damaged one passed over is said in one line (:mod:`vltrain.checkpoint.integrity`)."""
    pointer = folder / LATEST_FILE
    candidates = complete_checkpoints(folder)[::-1]
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and is_complete(folder / name):
            candidates.insert(0, folder / name)
    passed: list[str] = []
    for path in dict.fromkeys(candidates):
        wrong = damage(path)
        if wrong is None:
            if passed:
                log.warning(f"{'; '.join(passed)}: using {path}, the newest intact checkpoint")
            return path
        passed.append(f"checkpoint {path} is damaged ({wrong})")
    if passed:
        raise UserError(f"{'; '.join(passed)}; no intact checkpoint is left in {folder}: restore one from a "
                        "copy (train.resume=never starts the run afresh and writes over them)")
    return None
