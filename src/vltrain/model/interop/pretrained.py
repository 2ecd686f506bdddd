"""``model.init``: start from a Hugging Face CLIPModel / SiglipModel / BLIP folder or an OpenCLIP checkpoint.

:func:`imported_kind` tells the kinds apart (for :func:`vltrain.checkpoint.paths.locate`, the one
place that says what a path is); :func:`describe` reads what a checkpoint describes (its architecture
and preprocessing) without loading its weights; :func:`load_pretrained` then fills a model built for
that architecture.
Every tensor the model's towers, projections and temperature need comes from the checkpoint, and
every tensor of the checkpoint goes somewhere: anything else is an error naming the tensor. Heads
the checkpoint has no weights for (ITM, MLM, MIM) start fresh, and are listed. A CLIP checkpoint
read with more text positions than it has (:meth:`Pretrained.stretched`) gets its position table
stretched as it is read (:mod:`vltrain.model.interop.stretch`).

Files are read without running code: safetensors, or ``torch.load(weights_only=True)``, whose
refusal of a pickle that holds code becomes a plain error.
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import vltrain.model.interop.hf_blip as hf_blip
import vltrain.model.interop.hf_clip as hf_clip
import vltrain.model.interop.openclip as openclip
import vltrain.model.interop.openclip_coca as openclip_coca
from vltrain.errors import UserError
from vltrain.model.interop.convert import Link, Preprocessing, convert_in, leftover
from vltrain.model.interop.stretch import Stretch, check_stretch
from vltrain.model.presets import PRESETS, Architecture

CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")
HF_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOWER_PREFIXES = ("vision.", "text.", "image_proj.", "text_proj.", "logit_scale")


@dataclass
class Pretrained:
    """A checkpoint ``model.init`` names: what it describes, and where its weights are."""

    path: Path
    kind: str
    """hf-clip | hf-siglip | hf-siglip2 | hf-blip | openclip | openclip-coca"""
    arch: Architecture
    preprocessing: Preprocessing
    arch_from: str
    """Where the architecture came from, for messages ("in .../config.json", "inferred from ...")."""
    weights: Path | None = None
    """The weights file of an OpenCLIP checkpoint (``path`` itself, or the one in its folder)."""
    stretch: Stretch | None = None
    """Its text position table as it is read, when ``arch`` has more text positions than it."""

    def stretched(self, length: int, keep: int) -> Pretrained:
        """This checkpoint read with ``length`` text positions (``data.max_text_length``), its table
        stretched keeping ``keep`` rows (``model.text.stretch_keep``); one line where it cannot be."""
        stretch = check_stretch(self.arch.text, self.kind, length, keep, str(self.path))
        arch = replace(self.arch, text=replace(self.arch.text, max_length=length))
        notes = [*self.preprocessing.notes, stretch.describe()]
        pre = replace(self.preprocessing, max_text_length=length, notes=notes)
        return replace(self, arch=arch, preprocessing=pre, stretch=stretch)

    def weights_file(self) -> Path:
        if self.weights is not None:
            return self.weights
        found = next((self.path / n for n in HF_WEIGHTS if (self.path / n).is_file()), None)
        if found is None:
            raise UserError(f"{self.path} holds no weights ({', '.join(HF_WEIGHTS)}); save the model with "
                            "save_pretrained(folder)")
        return found

    def prepare(self, state: dict[str, torch.Tensor], source: str) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as the links read them."""
        if self.kind == "hf-blip":
            return hf_blip.prepare(state, self.arch, source)
        return openclip_coca.split(state, self.arch) if self.kind == "openclip-coca" else state

    def links(self, keys) -> list[Link]:
        if self.kind == "openclip-coca":
            return openclip_coca.links(self.arch)
        if self.kind == "openclip":
            return openclip.links(self.arch, keys)
        if self.kind == "hf-blip":
            return hf_blip.links(self.arch)
        return hf_clip.links(self.arch, self.kind.removeprefix("hf-"))

    def ignored(self) -> tuple[str, ...]:
        return {"openclip": openclip.IGNORED, "openclip-coca": openclip_coca.IGNORED}.get(self.kind, hf_clip.IGNORED)

    def parts(self) -> tuple[str, ...]:
        """The prefixes of our tensors the checkpoint must give; the model's others start fresh."""
        return hf_blip.parts(self.arch) if self.kind == "hf-blip" else TOWER_PREFIXES


IMPORTED_KINDS = ("hf-clip", "hf-siglip", "hf-siglip2", "hf-blip", "openclip", "openclip-coca")
"""What :func:`imported_kind` names: a Hugging Face folder's model type, an OpenCLIP CLIP or CoCa."""


def imported_kind(p: Path) -> str:
    """Which of :data:`IMPORTED_KINDS` ``p`` holds, read from its config.json or, for an OpenCLIP
    checkpoint, its tensor names (safetensors: the header only). ``p`` is a folder with config.json or
    an OpenCLIP config, or a checkpoint file (:func:`vltrain.checkpoint.paths.locate` asks). A folder
    with OpenCLIP's config and a config.json that is not transformers' (no ``model_type``: timm's, as
    OpenCLIP's Hub repositories of timm towers hold) is OpenCLIP's."""
    config = hf_clip.read_json(p / "config.json") if p.is_dir() and (p / "config.json").is_file() else None
    if config is not None and ("model_type" in config or not (p / openclip_coca.CONFIG_FILE).is_file()):
        return "hf-blip" if hf_blip.is_blip(config) else f"hf-{hf_clip.family_of(config, p)}"
    weights = openclip_coca.find_weights(p) if p.is_dir() else p
    return "openclip-coca" if openclip_coca.MARKER in read_shapes(weights) else "openclip"


def describe(path: Path, kind: str, preset: str = "", quick_gelu: bool = False) -> Pretrained:
    """The architecture and preprocessing of a checkpoint of ``kind`` (:func:`imported_kind`);
    ``preset``: OpenCLIP's head counts. Nothing but its config and tensor shapes is read."""
    if kind.startswith("hf-"):
        config = hf_clip.read_json(path / "config.json")
        arch = (hf_blip.architecture if kind == "hf-blip" else hf_clip.architecture)(path, config)
        pre = (hf_blip.preprocessing if kind == "hf-blip" else hf_clip.preprocessing)(path, config, arch)
        return Pretrained(path, kind, arch, pre, f"in {path}/config.json")
    config = openclip_coca.find_config(path)
    weights = openclip_coca.find_weights(path) if path.is_dir() else path
    return _open_openclip(weights, kind, preset, quick_gelu, config)


def _open_openclip(p: Path, kind: str, preset: str, quick_gelu: bool, config: Path | None) -> Pretrained:
    """An OpenCLIP checkpoint: CoCa from its model config, CLIP from its tensor shapes."""
    if kind == "openclip-coca":
        if config is None:
            raise openclip_coca.no_config(str(p))
        model_cfg = openclip_coca.read_model_config(config, str(p))
        arch = openclip_coca.architecture(model_cfg, str(p))
        data = hf_clip.read_json(config) if config.name == openclip_coca.CONFIG_FILE else {}
        pre = openclip_coca.preprocessing(p, arch, data.get("preprocess_cfg", {}) if isinstance(data, dict) else {})
        return Pretrained(p, "openclip-coca", arch, pre, f"in {config}", weights=p)
    shapes = read_shapes(p)
    arch = openclip.infer(shapes, str(p), quick_gelu)
    arch_from = "inferred from its tensor shapes"
    if preset:
        arch = openclip.with_preset(arch, PRESETS[preset](), preset, str(p))
        arch_from = f"of model.preset {preset}"
    return Pretrained(p, "openclip", arch, openclip.preprocessing(p, arch, "logit_bias" in shapes), arch_from, weights=p)


def _torch_load(path: Path) -> dict:
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UserError(f"{path} was refused: it is a pickle that holds more than tensors (code would run to load "
                        f"it), and vltrain loads weights only. Convert it to safetensors where you trust it. ({first})"
                        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def _unwrap(obj, path: Path) -> dict[str, torch.Tensor]:
    """A state dict from a saved state dict or an OpenCLIP training checkpoint ({"state_dict": ...},
    keys prefixed "module." by DDP)."""
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a {type(obj).__name__}, not a state dict of tensors")
    state = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
    if state and all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return state


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a weights file (safetensors, a shard index, or a torch file)."""
    if path.name.endswith(".index.json"):
        shards = sorted(set(hf_clip.read_json(path).get("weight_map", {}).values()))
        return {k: v for shard in shards for k, v in read_state_dict(path.parent / shard).items()}
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # safetensors raises its own error type on a bad header
            raise unreadable(path, e) from None
    return _unwrap(_torch_load(path), path)


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes, read from the header alone for safetensors."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except Exception as e:
            raise unreadable(path, e) from None
    return {k: tuple(v.shape) for k, v in read_state_dict(path).items()}


def unreadable(path: Path, e: Exception) -> UserError:
    """A safetensors file that is cut short or is not one: a failure of the file, not of the command."""
    return UserError(f"cannot read {path}: {e}; the file is damaged (cut short, or not safetensors): write it "
                     "again, e.g. with `vltrain export`, or name another copy")


def _module_names(links: list[Link]) -> list[str]:
    """Our modules ``links`` fill, blocks counted once ("text.blocks.*.cross")."""
    names = (re.sub(r"\.\d+\.", ".*.", link.ours).rsplit(".", 1)[0] for link in links)
    return sorted({".".join(name.split(".")[:4]) for name in names})


def load_pretrained(model: torch.nn.Module, source: Pretrained) -> list[str]:
    """Fill ``model`` (built for ``source.arch``) from the checkpoint; returns notes for the user."""
    file = source.weights_file()
    state = source.prepare(read_state_dict(file), str(file))
    links = source.links(state.keys())
    if source.stretch is not None:
        key = next(link.theirs[0] for link in links if link.ours == "text.pos_embed")
        state[key] = source.stretch.apply(state[key])
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tensors = convert_in(links, state, wanted, str(file), source.arch_from)
    notes = []
    unused = leftover([link for link in links if link.ours in wanted], state, source.ignored())
    if "logit_bias" in unused:
        unused.remove("logit_bias")
        notes.append("the checkpoint's logit_bias is not used: model.loss.siglip is 0")
    unbuilt = [link for link in links if link.ours not in wanted and link.ours != "logit_bias"]
    if unbuilt:  # parts the architecture has, left out because their objectives are off
        known = {k for link in unbuilt for k in link.theirs}
        unused = [k for k in unused if k not in known]
        notes.append(f"the checkpoint's {', '.join(_module_names(unbuilt))} not used: the objectives that train "
                     "them are off")
    if unused:
        raise UserError(f"{file} holds {len(unused)} tensor(s) this architecture has no place for, e.g. "
                        f"{', '.join(repr(k) for k in unused[:3])}: not a plain {source.kind} model")
    uncovered = [k for k in wanted if k.startswith(source.parts()) and k not in tensors]
    if uncovered:
        raise UserError(f"{file} has no weights for {uncovered[0]!r} ({len(uncovered)} in all)")
    fresh = sorted({k.split(".", 1)[0] for k in wanted if k not in tensors})
    if fresh:
        notes.append(f"initialized fresh (not in the checkpoint): {', '.join(fresh)}")
    model.load_state_dict(tensors, strict=False)
    return notes
