"""``vltrain export --format hf``: a folder ``transformers.CLIPModel`` / ``SiglipModel`` loads.

It holds config.json, model.safetensors (every tensor the transformers model has, none it lacks),
tokenizer.json with a tokenizer_config.json, and preprocessor_config.json (the run's image size,
resize, filter and statistics). A model is exported as CLIP when its architecture is CLIP's and as
SigLIP when it is SigLIP's (:func:`hf_family` says what differs otherwise): the same math, so the
embeddings are vltrain's. Fusion models (ITM / MLM over a fusion encoder) have no such equivalent.
Heads transformers has no place for (text_mlm, image_mim) are left out, and said so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import vltrain.model.interop.hf_clip as hf_clip
from vltrain.checkpoint.storage import write_weights
from vltrain.config.job import JobConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.model import VLModel
from vltrain.model.interop.convert import convert_out
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTransformer

HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}
RESAMPLE = {"bilinear": 2, "bicubic": 3}


def architecture_of(model: VLModel) -> Architecture:
    return Architecture(model.vision.cfg, model.text.cfg, model.embed_dim, None, model.image_proj.kind,
                        model.text_proj.kind)


def _differences(arch: Architecture, family: str) -> list[str]:
    """What keeps ``arch`` from being ``family``'s architecture (empty: it is)."""
    v, t, clip = arch.vision, arch.text, family == "clip"
    wanted = [
        (v.class_token == clip, "a class token" if clip else "no class token"),
        (v.pre_norm == clip, "a layer norm before the vision blocks" if clip else "none before them"),
        (v.pooling == ("cls" if clip else "map"), f"vision pooling {'cls' if clip else 'map'} (is {v.pooling})"),
        (v.patch_bias != clip, "a patch embedding " + ("without" if clip else "with") + " bias"),
        (t.causal == clip, "causal text attention" if clip else "bidirectional text attention"),
        (t.pooling == ("eos" if clip else "last"), f"text pooling {'eos' if clip else 'last'} (is {t.pooling})"),
        (t.pad_to_max_length != clip, "text padded to the batch" if clip else "fixed-length text"),
        (arch.image_proj == ("linear" if clip else "none"), f"image projection {'linear' if clip else 'none'}"),
        (arch.text_proj == ("linear" if clip else "linear_bias"), f"text projection {'linear' if clip else 'linear_bias'}"),
    ]
    return [what for ok, what in wanted if not ok]


def hf_family(model: VLModel, tokenizer: Tokenizer, name: str) -> str:
    """clip | siglip: the transformers model ``model`` is the same math as; a UserError says why none."""
    refuse = f"{name} cannot be exported with --format hf"
    if model.fusion is not None:
        raise UserError(f"{refuse}: fusion models (ITM/MLM over a fusion encoder, ALBEF-style) have no Hugging "
                        "Face CLIPModel or SiglipModel equivalent; use --format native")
    if not isinstance(model.text, TextTransformer):
        raise UserError(f"{refuse}: its text tower is a Hugging Face encoder (model.text.hf_path), which "
                        "CLIPModel and SiglipModel do not have; use --format native")
    arch = architecture_of(model)
    family = min(("clip", "siglip"), key=lambda f: len(_differences(arch, f)))
    missing = _differences(arch, family)
    if missing:
        raise UserError(f"{refuse}: transformers' {hf_clip.FAMILIES[family]} needs {'; '.join(missing)}. The CLIP "
                        "presets (clip-vit-*) and models started from model.init export; use --format native")
    if family == "clip":
        ids = tokenizer.encode("a", 8)[0]
        if tokenizer.eos_id is None or ids[-1] != tokenizer.eos_id or tokenizer.eos_id == 2:
            raise UserError(f"{refuse}: CLIPTextModel pools at the end-of-text token, and the tokenizer "
                            f"({tokenizer.path}) does not end every text with one (or its id is 2, which "
                            "transformers reads as a legacy config)")
    return family


def _text_config(arch: Architecture, model: VLModel, tokenizer: Tokenizer, family: str) -> dict:
    t = arch.text
    out = {"model_type": f"{family}_text_model", "vocab_size": model.text.token_embedding.num_embeddings,
           "hidden_size": t.width, "intermediate_size": round(t.width * t.mlp_ratio), "num_hidden_layers": t.depth,
           "num_attention_heads": t.heads, "max_position_embeddings": model.text.pos_embed.shape[0],
           "hidden_act": HF_ACT[t.act], "layer_norm_eps": t.norm_eps, "eos_token_id": tokenizer.eos_id}
    if family == "clip":
        return {**out, "projection_dim": arch.embed_dim, "bos_token_id": tokenizer.cls_id, "pad_token_id": tokenizer.pad_id}
    return {**out, "projection_size": arch.embed_dim, "bos_token_id": None, "pad_token_id": t.pad_id}


def hf_config(model: VLModel, tokenizer: Tokenizer, family: str) -> dict:
    arch = architecture_of(model)
    v = arch.vision
    vision = {"model_type": f"{family}_vision_model", "hidden_size": v.width,
              "intermediate_size": round(v.width * v.mlp_ratio), "num_hidden_layers": v.depth, "num_attention_heads": v.heads, "image_size": v.image_size,
              "patch_size": v.patch_size, "num_channels": 3, "hidden_act": HF_ACT[v.act], "layer_norm_eps": v.norm_eps}
    config = {"architectures": [hf_clip.FAMILIES[family]], "model_type": family,
              "text_config": _text_config(arch, model, tokenizer, family), "vision_config": vision}
    if family == "clip":
        vision["projection_dim"] = arch.embed_dim
        config.update(projection_dim=arch.embed_dim, logit_scale_init_value=float(model.logit_scale.detach()))
    else:
        vision["vision_use_head"] = True
    return config


def preprocessor_config(cfg: JobConfig, family: str) -> dict:
    """The run's image pipeline as a transformers image processor sees it."""
    d, s = cfg.data, cfg.data.image_size
    crop = d.resize == "crop"
    return {"image_processor_type": "SiglipImageProcessor" if family == "siglip" and not crop else "CLIPImageProcessor",
            "do_resize": True, "size": {"shortest_edge": s} if crop else {"height": s, "width": s},
            "do_center_crop": crop, **({"crop_size": {"height": s, "width": s}} if crop else {}),
            "resample": RESAMPLE[d.interpolation], "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(d.mean), "image_std": list(d.std), "do_convert_rgb": True}


def tokenizer_config(tokenizer: Tokenizer, cfg: JobConfig, pad_id: int) -> dict:
    """The tokenizer.json as it is (PreTrainedTokenizerFast), with its special tokens named."""
    name = tokenizer.hf.id_to_token
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.data.max_text_length,
           "pad_token": name(pad_id)}
    for key, i in (("bos_token", tokenizer.cls_id), ("eos_token", tokenizer.eos_id), ("mask_token", tokenizer.mask_id)):
        if i is not None:
            out[key] = name(i)
    return out


def write_hf(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, out: Path, family: str,
             metadata: dict[str, str]) -> list[str]:
    """Write the folder; returns notes for the user (heads left out)."""
    arch = architecture_of(model)
    state = model.state_dict()
    links = [link for link in hf_clip.links(arch, family) if link.ours in state]
    tensors = convert_out(links, state)
    notes = []
    if family == "siglip" and "logit_bias" not in tensors:
        tensors["logit_bias"] = torch.zeros(1)
        notes.append("the model has no SigLIP logit bias (model.loss.siglip_bias false): written as 0")
    left = sorted({k.split(".", 1)[0] for k in state if k not in {link.ours for link in links}})
    if left:
        notes.append(f"left out (transformers' {hf_clip.FAMILIES[family]} has no place for them): {', '.join(left)}")
    write_weights(out / "model.safetensors", tensors, metadata)
    pad_id = arch.text.pad_id if family == "siglip" else tokenizer.pad_id
    files = {"config.json": hf_config(model, tokenizer, family),
             "preprocessor_config.json": preprocessor_config(cfg, family),
             "tokenizer_config.json": tokenizer_config(tokenizer, cfg, pad_id)}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
    return notes
