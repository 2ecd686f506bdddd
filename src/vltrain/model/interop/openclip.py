"""OpenCLIP checkpoints (its ``CLIP`` and ``CustomTextCLIP`` ViT models): architecture and weights.

OpenCLIP's ViT-B/32 and ours are the same layout (our CLIP presets were built to match it), so
the tensors map one to one: ``in_proj_weight`` is already our ``qkv``; only the projections, which
OpenCLIP applies as ``x @ P``, are transposed. The architecture is read from the tensor shapes,
except what shapes cannot tell: the head counts (``model.preset`` gives them, else width / 64, as
every OpenCLIP ViT config has) and QuickGELU (``model.quick_gelu``).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

from vltrain.errors import UserError
from vltrain.model.interop.convert import OPENAI_MEAN, OPENAI_STD, Link, Preprocessing, linear, same
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTowerConfig
from vltrain.model.vision import VisionConfig

IGNORED = ("attn_mask", "input_resolution", "context_length", "vocab_size")
"""Entries of OpenAI's and older OpenCLIP state dicts that hold no weights."""
HEAD_WIDTH = 64


def text_prefix(keys) -> str:
    """``text.`` for CustomTextCLIP (the text tower in a module of its own), else empty."""
    return "text." if "text.token_embedding.weight" in keys else ""


def _depth(shapes: dict[str, tuple[int, ...]], prefix: str) -> int:
    found = [int(k[len(prefix):].split(".", 1)[0]) for k in shapes if k.startswith(prefix)]
    return max(found) + 1 if found else 0


def _require(shapes: dict[str, tuple[int, ...]], keys: list[str], source: str) -> None:
    for key in keys:
        if key not in shapes:
            raise UserError(f"{source} has no tensor {key!r}: it is not an OpenCLIP ViT checkpoint (a state dict "
                            "named as in open_clip's CLIP or CustomTextCLIP), or it is incomplete")


def infer(shapes: dict[str, tuple[int, ...]], source: str, quick_gelu: bool = False) -> Architecture:
    """The architecture the tensor shapes describe (heads: width / 64)."""
    t = text_prefix(shapes)
    _require(shapes, ["visual.conv1.weight", "visual.positional_embedding", "visual.proj",
                      "visual.transformer.resblocks.0.mlp.c_fc.weight", f"{t}token_embedding.weight",
                      f"{t}positional_embedding", f"{t}transformer.resblocks.0.mlp.c_fc.weight"], source)
    width, _, patch, _ = shapes["visual.conv1.weight"]
    grid = math.isqrt(shapes["visual.positional_embedding"][0] - 1)
    act = "quick_gelu" if quick_gelu else "gelu"
    vision = VisionConfig(
        image_size=patch * grid, patch_size=patch, width=width, depth=_depth(shapes, "visual.transformer.resblocks."),
        heads=max(1, width // HEAD_WIDTH), act=act,
        mlp_ratio=shapes["visual.transformer.resblocks.0.mlp.c_fc.weight"][0] / width,
    )
    vocab, text_width = shapes[f"{t}token_embedding.weight"]
    text = TextTowerConfig(
        vocab_size=vocab, max_length=shapes[f"{t}positional_embedding"][0], width=text_width,
        depth=_depth(shapes, f"{t}transformer.resblocks."), heads=max(1, text_width // HEAD_WIDTH),
        mlp_ratio=shapes[f"{t}transformer.resblocks.0.mlp.c_fc.weight"][0] / text_width,
        pooling="eos", causal=True, act=act,
    )
    return Architecture(vision, text, shapes["visual.proj"][1])


def with_preset(inferred: Architecture, preset: Architecture, name: str, source: str) -> Architecture:
    """The inferred architecture with the preset's head counts, once every size the two share agrees."""
    for tower in ("vision", "text"):
        ours, theirs = getattr(inferred, tower), getattr(preset, tower)
        for key in ("width", "depth", "mlp_ratio", "causal" if tower == "text" else "patch_size"):
            if getattr(ours, key) != getattr(theirs, key):
                raise UserError(f"{source} is not a {name}: its {tower} {key} is {getattr(ours, key)}, the preset's "
                                f"{getattr(theirs, key)}; give the matching model.preset, or none to infer it")
    if inferred.embed_dim != preset.embed_dim:
        raise UserError(f"{source} is not a {name}: its embeddings are {inferred.embed_dim}-d, the preset's "
                        f"{preset.embed_dim}-d")
    return replace(inferred, vision=replace(inferred.vision, heads=preset.vision.heads),
                   text=replace(inferred.text, heads=preset.text.heads))


def preprocessing(path: Path, arch: Architecture, has_bias: bool) -> Preprocessing:
    """OpenCLIP's default: OpenAI's statistics, the shorter side resized (bicubic) and the centre
    square cropped; the tokenizer.json beside the checkpoint, if there is one."""
    tokenizer = path.parent / "tokenizer.json"
    return Preprocessing(
        image_size=arch.vision.image_size, mean=list(OPENAI_MEAN), std=list(OPENAI_STD), resize="crop",
        interpolation="bicubic", max_text_length=arch.text.max_length,
        tokenizer=str(tokenizer) if tokenizer.is_file() else "", objective="siglip" if has_bias else "itc",
    )


def _block_links(ours: str, theirs: str) -> list[Link]:
    return [*linear(f"{ours}.norm1", f"{theirs}.ln_1"), same(f"{ours}.attn.qkv.weight", f"{theirs}.attn.in_proj_weight"),
            same(f"{ours}.attn.qkv.bias", f"{theirs}.attn.in_proj_bias"),
            *linear(f"{ours}.attn.out", f"{theirs}.attn.out_proj"), *linear(f"{ours}.norm2", f"{theirs}.ln_2"),
            *linear(f"{ours}.mlp.fc", f"{theirs}.mlp.c_fc"), *linear(f"{ours}.mlp.proj", f"{theirs}.mlp.c_proj")]


def links(arch: Architecture, keys) -> list[Link]:
    """Every tensor of an OpenCLIP ViT checkpoint with keys ``keys``, tied to ours."""
    t = text_prefix(keys)
    out = [same("vision.patch_embed.weight", "visual.conv1.weight"), same("vision.cls_token", "visual.class_embedding"),
           same("vision.pos_embed", "visual.positional_embedding"), *linear("vision.norm_pre", "visual.ln_pre")]
    for i in range(arch.vision.depth):
        out += _block_links(f"vision.blocks.{i}", f"visual.transformer.resblocks.{i}")
    out += [*linear("vision.norm", "visual.ln_post"), Link("image_proj.proj.weight", ("visual.proj",), transpose=True),
            same("text.token_embedding.weight", f"{t}token_embedding.weight"),
            same("text.pos_embed", f"{t}positional_embedding")]
    for i in range(arch.text.depth):
        out += _block_links(f"text.blocks.{i}", f"{t}transformer.resblocks.{i}")
    out += [*linear("text.norm", f"{t}ln_final"), Link("text_proj.proj.weight", (f"{t}text_projection",), transpose=True),
            same("logit_scale", "logit_scale")]
    return out + ([same("logit_bias", "logit_bias")] if "logit_bias" in keys else [])
