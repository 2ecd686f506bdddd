"""Hugging Face CLIPModel, SiglipModel and Siglip2Model folders: their architecture, preprocessing and weights.

The same math in another layout. CLIP: a pre-norm ViT with a class token and ln_pre, a causal text
tower pooled at the end-of-text token, bias-free projections and one temperature. SigLIP: a ViT
without class token or ln_pre whose attention-pool head ends at the embedding size, a text tower
attending over fixed-length padded text, pooled at the last position, with a biased linear head,
and a temperature plus a logit bias. Separate q, k, v projections become our ``qkv``. SigLIP 2's
NaFlex model (Siglip2Model) is SigLIP with images at their own shape: its patch embedding is a
linear layer over (y, x, channel) patches, and its square position table is resized to each
image's grid, as ``data.resize: native`` does.

``config.json`` may leave out values equal to transformers' defaults, so those defaults are here.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from vltrain.errors import UsageError, UserError
from vltrain.model.interop.convert import OPENAI_MEAN, OPENAI_STD, Link, Preprocessing, linear, same
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTowerConfig
from vltrain.model.vision import VisionConfig
from vltrain.pixels import INTERPOLATIONS, RESAMPLE, resample_name

_TOWER = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
DEFAULTS: dict[tuple[str, str], dict[str, Any]] = {
    ("clip", "text"): {**_TOWER, "vocab_size": 49408, "hidden_size": 512, "intermediate_size": 2048,
                       "num_attention_heads": 8, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                       "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 49406, "eos_token_id": 49407},
    ("clip", "vision"): {**_TOWER, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu",
                         "layer_norm_eps": 1e-5},
    ("siglip", "text"): {**_TOWER, "vocab_size": 32000, "max_position_embeddings": 64,
                         "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "pad_token_id": 1},
    ("siglip", "vision"): {**_TOWER, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                           "layer_norm_eps": 1e-6, "vision_use_head": True},
}
DEFAULTS[("siglip2", "text")] = DEFAULTS[("siglip", "text")]
DEFAULTS[("siglip2", "vision")] = {**_TOWER, "num_patches": 256, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                                   "layer_norm_eps": 1e-6, "vision_use_head": True}
"""transformers' defaults for the values a saved config.json may omit."""
ACTIVATIONS = {"gelu": "gelu", "quick_gelu": "quick_gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
"""transformers' hidden_act names -> ours; writing, ours -> the first of theirs."""
FAMILIES = {"clip": "CLIPModel", "siglip": "SiglipModel", "siglip2": "Siglip2Model"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read {path}: {e}") from None


def family_of(config: dict[str, Any], source: Path) -> str:
    family = config.get("model_type", "")
    if family not in FAMILIES:
        raise UsageError(f"{source}/config.json has model_type {family!r}, which vltrain does not open: it opens "
                        "Hugging Face folders of CLIPModel, SiglipModel, Siglip2Model and BLIP (BlipForConditional"
                        "Generation, BlipForImageTextRetrieval): model_type clip, siglip, siglip2 or blip")
    return family


def _tower(config: dict[str, Any], family: str, side: str) -> dict[str, Any]:
    given = config.get(f"{side}_config") or config.get(f"{side}_config_dict") or {}
    return {**DEFAULTS[(family, side)], **given}


def _act(name: str, source: Path, side: str) -> str:
    if name not in ACTIVATIONS:
        raise UserError(f"{source}/config.json: {side}_config.hidden_act {name!r} is not one vltrain has "
                        f"({', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def _table_side(v: dict[str, Any], source: Path) -> int:
    """Siglip2Model: the side, in pixels, of the square its position table was made for."""
    grid = math.isqrt(v["num_patches"])
    if grid * grid != v["num_patches"]:
        raise UserError(f"{source}/config.json: vision_config.num_patches {v['num_patches']} is not a square "
                        "number: its position table is not a square grid")
    return grid * v["patch_size"]


def _vision(v: dict[str, Any], family: str, source: Path) -> VisionConfig:
    image_size = _table_side(v, source) if family == "siglip2" else v["image_size"]
    cfg = VisionConfig(
        image_size=image_size, patch_size=v["patch_size"], width=v["hidden_size"], depth=v["num_hidden_layers"],
        heads=v["num_attention_heads"], mlp_ratio=v["intermediate_size"] / v["hidden_size"],
        act=_act(v["hidden_act"], source, "vision"), norm_eps=v["layer_norm_eps"],
    )
    if family == "clip":
        return cfg
    if not v.get("vision_use_head", True):
        raise UserError(f"{source}: a SigLIP vision tower without its attention-pool head (vision_use_head false) "
                        "has no image embedding to train")
    return replace(cfg, pooling="map", class_token=False, pre_norm=False, patch_bias=True)


def _text(t: dict[str, Any], family: str, source: Path) -> TextTowerConfig:
    cfg = TextTowerConfig(
        vocab_size=t["vocab_size"], max_length=t["max_position_embeddings"], width=t["hidden_size"],
        depth=t["num_hidden_layers"], heads=t["num_attention_heads"], mlp_ratio=t["intermediate_size"] / t["hidden_size"],
        act=_act(t["hidden_act"], source, "text"), norm_eps=t["layer_norm_eps"],
    )
    if family == "clip":
        return replace(cfg, pooling="eos", causal=True)
    return replace(cfg, pooling="last", pad_to_max_length=True, pad_id=_pad_id(source, t))


def _pad_id(folder: Path, t: dict[str, Any]) -> int:
    """SigLIP's padding token: tokenizer_config.json's pad_token (what its tokenizer pads with), else
    config.json's pad_token_id."""
    config = folder / "tokenizer_config.json"
    token = read_json(config).get("pad_token") if config.is_file() else None
    if isinstance(token, dict):
        token = token.get("content")
    if token and (folder / "tokenizer.json").is_file():
        import tokenizers

        found = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(token)
        if found is not None:
            return found
    return int(t["pad_token_id"])


def architecture(folder: Path, config: dict[str, Any]) -> Architecture:
    family = family_of(config, folder)
    vision = _vision(_tower(config, family, "vision"), family, folder)
    t = _tower(config, family, "text")
    text = _text(t, family, folder)
    if family == "clip":
        return Architecture(vision, text, int(config.get("projection_dim", 512)))
    embed_dim = int(t.get("projection_size") or t["hidden_size"])
    if embed_dim != vision.width:
        raise UserError(f"{folder}: SigLIP's text head gives {embed_dim}-d embeddings but its image tower "
                        f"{vision.width}-d ones")
    return Architecture(vision, text, embed_dim, image_proj="none", text_proj="linear_bias")


def image_processor(folder: Path) -> tuple[Path, dict[str, Any]]:
    """The folder's image processor settings: preprocessor_config.json, or the ``image_processor``
    part of processor_config.json (what transformers 5 writes); {} when there is neither."""
    path = folder / "preprocessor_config.json"
    if path.is_file():
        return path, read_json(path)
    joint = folder / "processor_config.json"
    if joint.is_file():
        return joint, dict(read_json(joint).get("image_processor") or {})
    return path, {}


def _native(pp: dict[str, Any], path: Path, arch: Architecture, notes: list[str]) -> dict[str, Any]:
    """Siglip2Model: images at their own shape, within the processor's patch budget."""
    patch = pp.get("patch_size", arch.vision.patch_size)
    if patch != arch.vision.patch_size:
        raise UserError(f"{path}: patch_size {patch} differs from the model's {arch.vision.patch_size}")
    return {"resize": "native", "max_patches": int(pp.get("max_num_patches", 256)),
            "interpolation": _interpolation(pp, path, "bilinear", notes)}


def preprocessing(folder: Path, config: dict[str, Any], arch: Architecture) -> Preprocessing:
    """preprocessor_config.json's image statistics, size, crop and filter; the folder's tokenizer."""
    family = family_of(config, folder)
    path, pp = image_processor(folder)
    notes = [] if pp else [f"{path.name} absent: {family.upper()}'s usual preprocessing assumed"]
    images = _native(pp, path, arch, notes) if family == "siglip2" else square_images(pp, path, arch, family, notes)
    default_stats = (OPENAI_MEAN, OPENAI_STD) if family == "clip" else ([0.5] * 3, [0.5] * 3)
    tokenizer = folder / "tokenizer.json"
    return Preprocessing(
        image_size=arch.vision.image_size, mean=list(pp.get("image_mean", default_stats[0])),
        std=list(pp.get("image_std", default_stats[1])), max_text_length=arch.text.max_length,
        tokenizer=str(tokenizer) if tokenizer.is_file() else "", objective="itc" if family == "clip" else "siglip",
        notes=notes, **images,
    )


def square_images(pp: dict[str, Any], path: Path, arch: Architecture, family: str, notes: list[str]) -> dict[str, Any]:
    """CLIPModel, SiglipModel (and BLIP): square images, cropped (CLIP's default) or squashed to the
    model's size."""
    crop = pp.get("do_center_crop", family == "clip")
    size = pp.get("crop_size") if crop else pp.get("size")
    side = (size or {}).get("height") or (size or {}).get("shortest_edge") if isinstance(size, dict) else size
    if side and side != arch.vision.image_size:
        notes.append(f"{path.name} prepares {side}-pixel images; the model's positions are for "
                     f"{arch.vision.image_size}, which is used")
    return {"resize": "crop" if crop else "squash", "interpolation": _interpolation(pp, path, "bicubic", notes)}


def _interpolation(pp: dict[str, Any], path: Path, default: str, notes: list[str]) -> str:
    """``data.interpolation`` for the processor's ``resample`` (Pillow's code; ``default``'s when absent)."""
    resample = pp.get("resample", RESAMPLE[default])
    name = resample_name(resample)
    if name in INTERPOLATIONS:
        return name
    notes.append(f"{path.name}: resample {resample} is neither bilinear nor bicubic; {default} is used")
    return default


def _layer_links(ours: str, theirs: str) -> list[Link]:
    qkv = [Link(f"{ours}.attn.qkv.{p}", tuple(f"{theirs}.self_attn.{x}_proj.{p}" for x in "qkv"))
           for p in ("weight", "bias")]
    return [*linear(f"{ours}.norm1", f"{theirs}.layer_norm1"), *qkv,
            *linear(f"{ours}.attn.out", f"{theirs}.self_attn.out_proj"),
            *linear(f"{ours}.norm2", f"{theirs}.layer_norm2"), *linear(f"{ours}.mlp.fc", f"{theirs}.mlp.fc1"),
            *linear(f"{ours}.mlp.proj", f"{theirs}.mlp.fc2")]


def _tower_links(arch: Architecture, family: str) -> list[Link]:
    v, t = "vision_model", "text_model"
    patch = linear("vision.patch_embed", f"{v}.embeddings.patch_embedding", arch.vision.patch_bias)
    if family == "siglip2":  # a linear layer over (y, x, channel) patches
        patch[0] = Link(patch[0].ours, patch[0].theirs, patch_hwc=arch.vision.patch_size)
    links = [*patch, same("vision.pos_embed", f"{v}.embeddings.position_embedding.weight")]
    if arch.vision.class_token:
        links.append(same("vision.cls_token", f"{v}.embeddings.class_embedding"))
    if arch.vision.pre_norm:
        links += linear("vision.norm_pre", f"{v}.pre_layrnorm")
    for i in range(arch.vision.depth):
        links += _layer_links(f"vision.blocks.{i}", f"{v}.encoder.layers.{i}")
    links += linear("vision.norm", f"{v}.post_layernorm")
    links += [same("text.token_embedding.weight", f"{t}.embeddings.token_embedding.weight"),
              same("text.pos_embed", f"{t}.embeddings.position_embedding.weight")]
    for i in range(arch.text.depth):
        links += _layer_links(f"text.blocks.{i}", f"{t}.encoder.layers.{i}")
    return links + linear("text.norm", f"{t}.final_layer_norm")


def links(arch: Architecture, family: str) -> list[Link]:
    """Every tensor of a CLIPModel / SiglipModel / Siglip2Model, tied to ours."""
    out = _tower_links(arch, family)
    if family == "clip":
        return out + [same("image_proj.proj.weight", "visual_projection.weight"),
                      same("text_proj.proj.weight", "text_projection.weight"), same("logit_scale", "logit_scale")]
    h = "vision_model.head"
    return out + [
        same("vision.head.probe", f"{h}.probe"), Link("vision.head.qkv.weight", (f"{h}.attention.in_proj_weight",)),
        Link("vision.head.qkv.bias", (f"{h}.attention.in_proj_bias",)),
        *linear("vision.head.out", f"{h}.attention.out_proj"),
        *linear("vision.head.norm", f"{h}.layernorm"), *linear("vision.head.mlp.fc", f"{h}.mlp.fc1"),
        *linear("vision.head.mlp.proj", f"{h}.mlp.fc2"), *linear("text_proj.proj", "text_model.head"),
        Link("logit_scale", ("logit_scale",), shape=(1,)), Link("logit_bias", ("logit_bias",), shape=(1,)),
    ]


IGNORED = ("position_ids",)
"""Buffers older transformers saved with the weights; they hold no weights."""
