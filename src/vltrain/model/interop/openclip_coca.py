"""OpenCLIP's CoCa: its model config read into an :class:`Architecture`, and its tensors tied to ours.

OpenCLIP's CoCa differs from our own ``tiny-coca`` in structure, and each difference is an option of
our modules, so the same weights compute the same function:

- the vision tower ends in an attentional pooler (``VisionConfig.pooling`` attn_pool): 256 learned
  queries over the blocks' tokens, the first pooled for the contrastive embedding, the other 255
  read by the decoder;
- the text tower appends a class token after the text padded to its context length and pools it
  (``TextTowerConfig.pooling`` appended), and hands the decoder its tokens before the final norm;
- each decoder layer is a causal self-attention block and a cross-attention block, each with its
  own feed-forward, the image tokens normed once more (``DecoderConfig.separate_cross``).

The architecture comes from OpenCLIP's own model config (``open_clip_config.json`` beside the
weights, as the Hugging Face Hub and ``export --format openclip`` keep it, or a ``model_configs``
file such as ``coca_ViT-B-32.json``): head counts and the pooler's size cannot be read off shapes.
``nn.MultiheadAttention`` keeps q, k and v in one ``in_proj`` matrix where ours keeps the query
apart from the keys and values (they read another sequence), so :func:`split` cuts those rows into
named parts before the links read them and :func:`join` glues them back for export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vltrain.errors import UserError
from vltrain.model.decoder import DecoderConfig
from vltrain.model.interop.convert import OPENAI_MEAN, OPENAI_STD, Link, Preprocessing, linear, same
from vltrain.model.interop.openclip import _block_links
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTowerConfig
from vltrain.model.vision import VisionConfig

CONFIG_FILE = "open_clip_config.json"
WEIGHT_FILES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                "open_clip_pytorch_model.pth")
"""The weights files OpenCLIP looks for in a model folder, in its order."""
MARKER = "text_decoder.ln_final.weight"
"""A tensor only a CoCa state dict holds."""
IGNORED = ("attn_mask",)

SUPPORTED = {
    "vision_cfg": {"image_size", "layers", "width", "head_width", "mlp_ratio", "patch_size", "attentional_pool",
                   "attn_pooler_queries", "attn_pooler_heads", "output_tokens", "patch_dropout"},
    "text_cfg": {"context_length", "vocab_size", "width", "heads", "layers", "mlp_ratio", "embed_cls", "pad_id",
                 "output_tokens", "hf_tokenizer_name", "tokenizer_kwargs", "tokenizer_mode", "eos_id"},
    "multimodal_cfg": {"context_length", "vocab_size", "width", "heads", "layers", "attn_pooler_heads", "mlp_ratio",
                       "dim_head", "n_queries", "output_tokens"},
}
"""The keys of OpenCLIP's CoCa config whose meaning our modules reproduce; any other key set to a
value other than OpenCLIP's default is refused (``_check``)."""
DEFAULTS = {"ls_init_value": None, "no_ln_pre": False, "final_ln_after_pool": False, "pos_embed_type": "learnable",
            "proj_bias": False, "proj_type": "linear", "no_causal_mask": False, "timm_model_name": None,
            "hf_model_name": None, "act_kwargs": None, "norm_kwargs": None, "ls_init": None, "input_patchnorm": False,
            "global_average_pool": False, "pool_type": "tok"}


def find_config(path: Path) -> Path | None:
    """OpenCLIP's config beside a weights file, or in a model folder."""
    folder = path if path.is_dir() else path.parent
    found = folder / CONFIG_FILE
    return found if found.is_file() else None


def find_weights(folder: Path) -> Path:
    found = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if found is None:
        raise UserError(f"model.init {folder}: an OpenCLIP model folder, but no weights in it ({', '.join(WEIGHT_FILES)})")
    return found


def read_model_config(path: Path, source: str) -> dict:
    """``model_cfg`` of an ``open_clip_config.json``, or a ``model_configs/NAME.json`` file itself."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read OpenCLIP's model config {path} (for {source}): {e}") from None
    cfg = data.get("model_cfg", data) if isinstance(data, dict) else None
    if not isinstance(cfg, dict) or "vision_cfg" not in cfg or "text_cfg" not in cfg:
        raise UserError(f"{path} is not an OpenCLIP model config: it needs vision_cfg and text_cfg "
                        "(under model_cfg in an open_clip_config.json)")
    return cfg


def no_config(source: str) -> UserError:
    return UserError(f"{source} is an OpenCLIP CoCa checkpoint, but its model config was not found: its head counts "
                     f"and pooler cannot be read off the tensors. Put OpenCLIP's config beside it as {CONFIG_FILE} "
                     "(as the Hugging Face Hub has it: {\"model_cfg\": ...}), or copy the model's "
                     "open_clip/model_configs/NAME.json there under that name")


def _check(cfg: dict, source: str) -> None:
    if "multimodal_cfg" not in cfg:
        raise UserError(f"{source}: its OpenCLIP config has no multimodal_cfg, so it is not a CoCa model")
    for part, known in SUPPORTED.items():
        for key, value in cfg.get(part, {}).items():
            if key in known or (key in DEFAULTS and value == DEFAULTS[key]):
                continue
            raise UserError(f"{source}: OpenCLIP config {part}.{key} = {value!r} is not supported (vltrain reads "
                            f"OpenCLIP's CoCa with ViT towers and its default options)")
    vision, text = cfg["vision_cfg"], cfg["text_cfg"]
    if vision.get("attentional_pool") is not True:
        raise UserError(f"{source}: vision_cfg.attentional_pool is {vision.get('attentional_pool')!r}; vltrain reads "
                        "OpenCLIP's original CoCa pooler (true), not the parallel or cascade ones")
    if not text.get("embed_cls"):
        raise UserError(f"{source}: text_cfg.embed_cls is not true; OpenCLIP's CoCa pools an appended class token")


def architecture(cfg: dict, source: str) -> Architecture:
    """The :class:`Architecture` OpenCLIP builds from ``cfg`` (its CoCa model config)."""
    _check(cfg, source)
    vision, text, multi = cfg["vision_cfg"], cfg["text_cfg"], cfg["multimodal_cfg"]
    embed_dim = int(cfg["embed_dim"])
    act = "quick_gelu" if cfg.get("quick_gelu") else "gelu"
    width = int(vision.get("width", 768))
    v = VisionConfig(
        image_size=int(vision.get("image_size", 224)), patch_size=int(vision.get("patch_size", 16)), width=width,
        depth=int(vision.get("layers", 12)), heads=width // int(vision.get("head_width", 64)),
        mlp_ratio=float(vision.get("mlp_ratio", 4.0)), pooling="attn_pool", act=act,
        pool_queries=int(vision.get("attn_pooler_queries", 256)), pool_heads=int(vision.get("attn_pooler_heads", 8)),
        pool_width=embed_dim,
    )
    t = TextTowerConfig(
        vocab_size=int(text.get("vocab_size", 49408)), max_length=int(text.get("context_length", 77)),
        width=int(text.get("width", 512)), depth=int(text.get("layers", 12)), heads=int(text.get("heads", 8)),
        mlp_ratio=float(text.get("mlp_ratio", 4.0)), pooling="appended", causal=True, act=act,
        pad_id=int(text.get("pad_id", 0)),
    )
    if int(multi.get("width", 512)) != t.width:
        raise UserError(f"{source}: multimodal_cfg.width {multi.get('width')} differs from text_cfg.width {t.width}; "
                        "vltrain's decoder reads the text tower's tokens at their own width")
    if embed_dim != t.width:
        raise UserError(f"{source}: embed_dim {embed_dim} differs from the decoder's width {t.width}; OpenCLIP's CoCa "
                        "decoder attends to the image tokens at its own width")
    # OpenCLIP builds the decoder's MLP at its default ratio, 4, whatever multimodal_cfg says
    d = DecoderConfig(depth=int(multi.get("layers", 12)), heads=int(multi.get("heads", 8)), mlp_ratio=4.0, act=act,
                      separate_cross=True)
    return Architecture(v, t, embed_dim, decoder=d)


def model_config(arch: Architecture) -> dict:
    """OpenCLIP's CoCa model config of ``arch`` (an architecture :func:`architecture` can give)."""
    v, t, d = arch.vision, arch.text, arch.decoder
    return {
        "embed_dim": arch.embed_dim,
        "quick_gelu": v.act == "quick_gelu",
        "vision_cfg": {"image_size": v.image_size, "layers": v.depth, "width": v.width,
                       "head_width": v.width // v.heads, "mlp_ratio": v.mlp_ratio, "patch_size": v.patch_size,
                       "attentional_pool": True, "attn_pooler_queries": v.pool_queries,
                       "attn_pooler_heads": v.pool_heads, "output_tokens": True},
        "text_cfg": {"context_length": t.max_length, "vocab_size": t.vocab_size, "width": t.width, "heads": t.heads,
                     "layers": t.depth, "mlp_ratio": t.mlp_ratio, "embed_cls": True, "pad_id": t.pad_id,
                     "output_tokens": True},
        "multimodal_cfg": {"context_length": t.max_length, "vocab_size": t.vocab_size, "width": t.width,
                           "heads": d.heads, "layers": d.depth, "attn_pooler_heads": v.pool_heads},
        "custom_text": True,
    }


def exportable(arch: Architecture) -> str:
    """Why a model of ``arch`` cannot be written as OpenCLIP's CoCa ("" when it can)."""
    v, t, d = arch.vision, arch.text, arch.decoder
    checks = [
        (d is not None, "a captioning decoder"),
        (v.pooling == "attn_pool", "an attentional pooler in the vision tower (vision pooling attn_pool)"),
        (t.pooling == "appended" and t.causal, "a causal text tower pooled at an appended class token"),
        (d is not None and d.separate_cross and not d.post_norm and not d.tied and d.mlp_ratio == 4.0
         and d.head == "linear", "pre-norm decoder layers with separate cross-attention blocks, MLPs of ratio 4 "
                                 "(OpenCLIP builds no other) and an untied linear output"),
        (not (t.post_norm or t.embed_norm or t.start_id is not None),
         "a pre-norm text tower without an embedding norm, reading its tokenizer's start token"),
        (v.class_token and v.pre_norm and not v.patch_bias, "a ViT with a class token and a norm before its blocks"),
        (arch.fusion is None, "no fusion encoder"),
        (arch.image_proj == "linear" and arch.text_proj == "linear", "bias-free projections"),
        (arch.embed_dim == (v.pool_width or v.width) == t.width, "one width for the embeddings, the pooled tokens and "
                                                                 "the text"),
        (v.act == t.act and (d is None or d.act == t.act), "one activation throughout"),
        (v.norm_eps == t.norm_eps == 1e-5, "layer norms of eps 1e-5"),
    ]
    missing = [what for ok, what in checks if not ok]
    return "; ".join(missing)


def preprocessing(path: Path, arch: Architecture, preprocess: dict) -> Preprocessing:
    """OpenCLIP's preprocessing (its ``preprocess_cfg`` where the folder has one, else its defaults:
    OpenAI's statistics, bicubic, the shorter side resized and the centre cropped)."""
    folder = path if path.is_dir() else path.parent
    tokenizer = folder / "tokenizer.json"
    notes = []
    resize = {"shortest": "crop", "squash": "squash"}.get(preprocess.get("resize_mode", "shortest"))
    if resize is None:
        notes.append(f"preprocess_cfg.resize_mode {preprocess['resize_mode']!r} read as crop (the shorter side "
                     "resized, the centre cropped)")
        resize = "crop"
    return Preprocessing(
        image_size=arch.vision.image_size, mean=list(preprocess.get("mean", OPENAI_MEAN)),
        std=list(preprocess.get("std", OPENAI_STD)), resize=resize,
        interpolation=preprocess.get("interpolation", "bicubic"), max_text_length=arch.text.max_length,
        tokenizer=str(tokenizer) if tokenizer.is_file() else "", objective="itc", notes=notes,
    )


def _splits(arch: Architecture) -> list[tuple[str, list[int]]]:
    """Their tensors whose rows ours keep in two parts, q and kv: (key, [q rows, kv rows])."""
    w, p = arch.text.width, arch.vision.pool_width or arch.vision.width
    out = [("visual.attn_pool.attn.in_proj_bias", [p, 2 * p])]
    if p == arch.vision.width:  # nn.MultiheadAttention keeps q, k, v in one matrix only when all are one width
        out.append(("visual.attn_pool.attn.in_proj_weight", [p, 2 * p]))
    for i in range(arch.decoder.depth):
        out += [(f"text_decoder.cross_attn.{i}.attn.{name}", [w, 2 * w]) for name in ("in_proj_weight", "in_proj_bias")]
    return out


POOL = "visual.attn_pool.attn."


def split(state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """``state`` with each of :func:`_splits`' tensors replaced by its parts, named ``KEY@q`` and
    ``KEY@kv``. The pooler's k and v projections, apart in OpenCLIP when the tokens are wider than
    the queries, become one ``kv`` part too."""
    out = dict(state)
    if f"{POOL}q_proj_weight" in out:
        out[f"{POOL}in_proj_weight@q"] = out.pop(f"{POOL}q_proj_weight")
        out[f"{POOL}in_proj_weight@kv"] = torch.cat([out.pop(f"{POOL}k_proj_weight"), out.pop(f"{POOL}v_proj_weight")])
    for key, sizes in _splits(arch):
        if key not in out:
            continue  # convert_in names the missing part
        t = out.pop(key)
        if t.shape[0] != sum(sizes):
            raise UserError(f"tensor {key!r} has {t.shape[0]} rows, but the architecture needs {sum(sizes)}")
        out[f"{key}@q"], out[f"{key}@kv"] = t.split(sizes)
    return out


def join(state: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """The reverse of :func:`split`: OpenCLIP's layout."""
    out = dict(state)
    for key, _ in _splits(arch):
        out[key] = torch.cat([out.pop(f"{key}@q"), out.pop(f"{key}@kv")]).contiguous()
    if f"{POOL}in_proj_weight@q" in out:
        out[f"{POOL}q_proj_weight"] = out.pop(f"{POOL}in_proj_weight@q")
        out[f"{POOL}k_proj_weight"], out[f"{POOL}v_proj_weight"] = (
            t.contiguous() for t in out.pop(f"{POOL}in_proj_weight@kv").chunk(2))
    return out


def _pieces(ours: str, theirs: str) -> list[Link]:
    """Our q / kv linear layers from the parts of their in_proj."""
    return [same(f"{ours}.q.weight", f"{theirs}.in_proj_weight@q"), same(f"{ours}.q.bias", f"{theirs}.in_proj_bias@q"),
            same(f"{ours}.kv.weight", f"{theirs}.in_proj_weight@kv"),
            same(f"{ours}.kv.bias", f"{theirs}.in_proj_bias@kv"), *linear(f"{ours}.out", f"{theirs}.out_proj")]


def links(arch: Architecture) -> list[Link]:
    """Every tensor of an OpenCLIP CoCa state dict (after :func:`split`), tied to ours."""
    out = [same("vision.patch_embed.weight", "visual.conv1.weight"), same("vision.cls_token", "visual.class_embedding"),
           same("vision.pos_embed", "visual.positional_embedding"), *linear("vision.norm_pre", "visual.ln_pre")]
    for i in range(arch.vision.depth):
        out += _block_links(f"vision.blocks.{i}", f"visual.transformer.resblocks.{i}")
    out += [same("vision.pooler.query", "visual.attn_pool.query"), *linear("vision.pooler.norm_q", "visual.attn_pool.ln_q"),
            *linear("vision.pooler.norm_k", "visual.attn_pool.ln_k"),
            *_pieces("vision.pooler", "visual.attn_pool.attn"),
            *linear("vision.norm", "visual.ln_post"), Link("image_proj.proj.weight", ("visual.proj",), transpose=True),
            same("text.token_embedding.weight", "text.token_embedding.weight"),
            same("text.pos_embed", "text.positional_embedding"), same("text.cls_token", "text.cls_emb")]
    for i in range(arch.text.depth):
        out += _block_links(f"text.blocks.{i}", f"text.transformer.resblocks.{i}")
    out += [*linear("text.norm", "text.ln_final"), Link("text_proj.proj.weight", ("text.text_projection",), transpose=True)]
    for i in range(arch.decoder.depth):
        ours, theirs = f"decoder.blocks.{i}", f"text_decoder.cross_attn.{i}"
        out += _block_links(f"{ours}.text", f"text_decoder.resblocks.{i}")
        out += [*linear(f"{ours}.image.norm1", f"{theirs}.ln_1"), *linear(f"{ours}.image.norm_image", f"{theirs}.ln_1_kv"),
                *_pieces(f"{ours}.image.cross", f"{theirs}.attn"), *linear(f"{ours}.image.norm2", f"{theirs}.ln_2"),
                *linear(f"{ours}.image.mlp.fc", f"{theirs}.mlp.c_fc"),
                *linear(f"{ours}.image.mlp.proj", f"{theirs}.mlp.c_proj")]
    out += [*linear("decoder.norm", "text_decoder.ln_final"),
            Link("decoder.head.weight", ("text_decoder.text_projection",), transpose=True), same("logit_scale", "logit_scale")]
    return out
