"""``vltrain export --format openclip``: a CoCa model as the folder OpenCLIP opens.

The folder holds open_clip_config.json (``model_cfg``, OpenCLIP's CoCa config of the model, and
``preprocess_cfg``, the run's image size, resize, filter and statistics), open_clip_model.safetensors
(every tensor of OpenCLIP's ``CoCa``, none it lacks) and the run's tokenizer.json.
``open_clip.create_model_from_pretrained("local-dir:FOLDER")`` builds the model from it, and
``model.init`` reads it back. Only models of OpenCLIP's CoCa structure can be written
(:func:`vltrain.model.interop.openclip_coca.exportable` names what else differs): the
``coca-vit-b32`` preset and models read from OpenCLIP.
"""

from __future__ import annotations

import json
from pathlib import Path

import vltrain.model.interop.openclip_coca as coca
from vltrain.checkpoint.storage import write_weights
from vltrain.config.job import JobConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.export.hf import architecture_of
from vltrain.model import VLModel
from vltrain.model.interop.convert import convert_out
from vltrain.model.presets import Architecture

RESIZE_MODE = {"crop": "shortest", "squash": "squash"}


def check_openclip(model: VLModel, cfg: JobConfig, name: str) -> Architecture:
    """The architecture of ``model`` when OpenCLIP's CoCa can hold it; else one line saying why."""
    arch = architecture_of(model)
    missing = coca.exportable(arch)
    if missing:
        raise UserError(f"{name}: --format openclip writes OpenCLIP's CoCa, and this model lacks {missing}. Train "
                        "from model.preset coca-vit-b32 or an OpenCLIP CoCa checkpoint, or export --format native")
    if cfg.data.resize not in RESIZE_MODE:
        raise UserError(f"{name}: --format openclip: OpenCLIP resizes images to a square, and this run read them "
                        f"with data.resize {cfg.data.resize}")
    return arch


def write_openclip(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, out: Path, arch: Architecture,
                   metadata: dict[str, str]) -> list[str]:
    """Write the folder; returns notes for the user (heads left out)."""
    state = model.state_dict()
    links = [link for link in coca.links(arch) if link.ours in state]
    tensors = coca.join(convert_out(links, state), arch)
    write_weights(out / coca.WEIGHT_FILES[0], tensors, metadata)
    d = cfg.data
    config = {"model_cfg": coca.model_config(arch),
              "preprocess_cfg": {"size": d.image_size, "mean": list(d.mean), "std": list(d.std),
                                 "interpolation": d.interpolation, "resize_mode": RESIZE_MODE[d.resize]}}
    (out / coca.CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    left = sorted({k.split(".", 1)[0] for k in state if k not in {link.ours for link in links}})
    return [f"left out (OpenCLIP's CoCa has no place for them): {', '.join(left)}"] if left else []
