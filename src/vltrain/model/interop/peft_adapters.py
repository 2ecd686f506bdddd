"""LoRA adapters in peft's own folder (``adapter_config.json``, ``adapter_model.safetensors``) for a
transformers CLIPModel / SiglipModel, tied to ours.

peft names an adapter by the layer of the transformers model it sits on
(``base_model.model.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight``); ours sit on the
same layers of our blocks (``vision.blocks.0.attn.qkv.q_proj.lora_A.default.weight``: the fused q, k,
v projection split in three, :mod:`vltrain.model.lora`). Which layer is which comes from
:func:`vltrain.model.interop.hf_clip.links`, which tie our weights to transformers'; the blocks carry
the same names in every family. :func:`adapter_tensors` gives our adapters under peft's names
(``vltrain export --adapters``), and :func:`read_adapters` puts peft's into a model that has its
adapters (``train.lora.adapters``), refusing adapters made for another base.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

import vltrain.model.interop.hf_clip as hf_clip
from vltrain.errors import ConfigError, UserError
from vltrain.model.interop.pretrained import read_state_dict
from vltrain.model.lora import ADAPTER, SPLIT, LoraSettings
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTransformer

log = logging.getLogger("vltrain")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
"""What peft puts before a layer's name in the file (the PeftModel around the transformers model)."""
MATRICES = ("lora_A", "lora_B")
UNSUPPORTED = {"use_dora": False, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}, "bias": "none",
               "modules_to_save": None, "lora_bias": False}
"""peft options train.lora has not, at the value that means they are off."""


def layer_names(model: nn.Module) -> dict[str, str]:
    """Each layer of the towers' blocks, ours (q, k and v apart) -> its name in transformers' model."""
    if not isinstance(getattr(model, "text", None), TextTransformer):
        raise UserError("peft's adapters are written and read for a transformers CLIPModel or SiglipModel, and "
                        "this model's text tower is not theirs (a Hugging Face text encoder, model.text.hf_path)")
    names = {}
    for link in hf_clip.links(Architecture(model.vision.cfg, model.text.cfg, model.embed_dim), "clip"):
        if ".blocks." not in link.ours or not link.ours.endswith(".weight"):
            continue
        ours, theirs = link.ours.removesuffix(".weight"), [t.removesuffix(".weight") for t in link.theirs]
        if len(theirs) == len(SPLIT):  # our fused q, k, v projection is their three
            names.update({f"{ours}.{part}": name for part, name in zip(SPLIT, theirs)})
        else:
            names[ours] = theirs[0]
    return names


def adapter_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The model's adapter matrices under the keys of peft's file (``PREFIX``, no adapter name)."""
    names = layer_names(model)
    out = {}
    for name, module in model.named_modules():
        if ADAPTER not in getattr(module, "lora_A", {}):
            continue
        if name not in names:
            raise UserError(f"the adapters on {name} have no place in a transformers CLIPModel or SiglipModel")
        for matrix in MATRICES:
            out[f"{PREFIX}{names[name]}.{matrix}.weight"] = getattr(module, matrix)[ADAPTER].weight
    return out


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters as peft saves them: by key, detached, on the CPU."""
    return {key: p.detach().cpu() for key, p in adapter_parameters(model).items()}


def read_config(folder: Path) -> dict[str, Any]:
    """adapter_config.json; a folder without one is refused, naming the key that gave it."""
    if not folder.is_dir():
        raise ConfigError(f"train.lora.adapters={folder}: no such folder; give the folder peft's save_pretrained "
                          f"(or vltrain export --adapters) wrote, with {CONFIG_FILE} and {WEIGHTS_FILE}")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (folder / name).is_file():
            raise ConfigError(f"train.lora.adapters={folder} has no {name}: give the folder peft's save_pretrained "
                              f"(or vltrain export --adapters) wrote, with {CONFIG_FILE} and {WEIGHTS_FILE}")
    return hf_clip.read_json(folder / CONFIG_FILE)


def check_config(config: dict[str, Any], lora: LoraSettings, path: Path) -> None:
    """The adapters' rank, scale and targets are the run's (``train.lora``), and they are plain LoRA."""
    if config.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{path}: peft_type {config.get('peft_type')!r}; train.lora.adapters reads LoRA adapters")
    for key, off in UNSUPPORTED.items():
        if config.get(key, off) not in (off, None):
            raise ConfigError(f"{path}: {key} {config[key]!r}; train.lora reads plain LoRA adapters (without "
                              f"{', '.join(UNSUPPORTED)})")
    alpha = lora.alpha or lora.rank
    if config.get("r") != lora.rank:
        raise ConfigError(f"{path}: r {config.get('r')}, and train.lora.rank is {lora.rank}: set "
                          f"train.lora.rank={config.get('r')}")
    if float(config.get("lora_alpha", 8)) != float(alpha):
        raise ConfigError(f"{path}: lora_alpha {config.get('lora_alpha', 8)}, and train.lora.alpha is {alpha:g}: "
                          f"set train.lora.alpha={config.get('lora_alpha', 8)}")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a pattern: the tensors say what it matched)
        theirs = sorted({t.rpartition(".")[2] for t in targets})
        if theirs != sorted(set(lora.targets)):
            raise ConfigError(f"{path}: target_modules adapt {', '.join(theirs)}, and train.lora.targets is "
                              f"[{','.join(lora.targets)}]: set train.lora.targets=[{','.join(theirs)}]")


@torch.no_grad()
def read_adapters(model: nn.Module, lora: LoraSettings, init: str) -> None:
    """Fill the adapters :func:`~vltrain.model.lora.add_adapters` put on ``model`` from peft's folder
    ``lora.adapters``, made for the transformers model ``init`` (``model.init``) names. Adapters for
    another base are refused in one line that names the first difference: a layer the model has not
    or does not adapt, one it adapts that they lack, a shape."""
    folder = Path(lora.adapters)
    config = read_config(folder)
    check_config(config, lora, folder / CONFIG_FILE)
    base = config.get("base_model_name_or_path")
    if base and str(base) != str(init):
        log.info(f"train.lora.adapters: {folder} was saved for {base}, and model.init is {init}; read as long as "
                 "the shapes fit")
    file = folder / WEIGHTS_FILE
    theirs = {(k if k.startswith(PREFIX) else PREFIX + k): v for k, v in read_state_dict(file).items()}
    ours = adapter_parameters(model)
    known = {f"{PREFIX}{name}" for name in layer_names(model).values()}
    for key in theirs:
        if key not in ours:
            layer = key.removeprefix(PREFIX).rpartition(".lora_")[0]
            if f"{PREFIX}{layer}" in known:
                raise ConfigError(f"{file} adapts {layer}, which this run does not: train.lora.towers, .targets and "
                                  ".last_blocks must name the layers the adapters were trained on")
            raise ConfigError(f"{file} holds {key}, and the model has no such layer: adapters for another base "
                              f"than model.init={init}")
    for key, param in ours.items():
        if key not in theirs:
            raise ConfigError(f"{file} has no {key}, and this run adapts that layer: train.lora.towers, .targets and "
                              ".last_blocks must name the layers the adapters were trained on")
        if tuple(theirs[key].shape) != tuple(param.shape):
            raise ConfigError(f"{file}: {key} is {list(theirs[key].shape)}, and the model's is {list(param.shape)}: "
                              f"adapters for another base than model.init={init}")
    for key, param in ours.items():
        param.copy_(theirs[key])
