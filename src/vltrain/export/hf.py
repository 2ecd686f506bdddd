"""``vltrain export --format hf``: a folder ``transformers.CLIPModel`` / ``SiglipModel`` /
``Siglip2Model`` loads (a BLIP captioner's: :mod:`vltrain.export.hf_blip`).

It holds config.json, model.safetensors (every tensor the transformers model has, none it lacks),
tokenizer.json with a tokenizer_config.json, and preprocessor_config.json (the run's image size,
resize, filter and statistics). A model is exported as CLIP when its architecture is CLIP's and as
SigLIP when it is SigLIP's (:func:`hf_family` says what differs otherwise): the same math, so the
embeddings are vltrain's. A model reading images at their own shape (``data.resize: native``) is
exported as SigLIP 2's NaFlex model, the only transformers model that reads them, and only where
transformers would preprocess its images and text as the run did (:func:`check_siglip2_tokenizer`).
Fusion models (ITM / MLM over a fusion encoder) have no such equivalent. Heads transformers has no
place for (text_mlm, image_mim) are left out, and said so.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

import vltrain.model.interop.hf_blip as hf_blip
import vltrain.model.interop.hf_clip as hf_clip
from vltrain.checkpoint.storage import write_weights
from vltrain.config.job import JobConfig
from vltrain.data.tokenizers import Tokenizer
from vltrain.errors import UserError
from vltrain.model import VLModel
from vltrain.model.interop.convert import convert_out
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTransformer
from vltrain.pixels import RESAMPLE

HF_ACT = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu"}


def architecture_of(model: VLModel) -> Architecture:
    """The architecture of a built model, its fusion encoder and decoder included."""
    return Architecture(model.vision.cfg, model.text.cfg, model.embed_dim,
                        None if model.fusion is None else model.fusion.cfg, model.image_proj.kind,
                        model.text_proj.kind, None if model.decoder is None else model.decoder.cfg)


def _differences(arch: Architecture, family: str) -> list[str]:
    """What keeps ``arch`` from being ``family``'s architecture (empty: it is)."""
    v, t, clip = arch.vision, arch.text, family == "clip"
    wanted = [
        (v.class_token == clip, "a class token" if clip else "no class token"),
        (v.pre_norm == clip, ("a" if clip else "no") + " layer norm before the vision blocks"),
        (v.pooling == ("cls" if clip else "map"), f"vision pooling {'cls' if clip else 'map'} (is {v.pooling})"),
        (v.patch_bias != clip, "a patch embedding " + ("without" if clip else "with") + " bias"),
        (t.causal == clip, "causal text attention" if clip else "bidirectional text attention"),
        (not (t.post_norm or t.embed_norm or t.start_id is not None),
         "a pre-norm text tower without an embedding norm, reading its tokenizer's start token"),
        (t.pooling == ("eos" if clip else "last"), f"text pooling {'eos' if clip else 'last'} (is {t.pooling})"),
        (t.pad_to_max_length != clip, "text padded to the batch" if clip else "fixed-length text"),
        (arch.image_proj == ("linear" if clip else "none"), f"image projection {'linear' if clip else 'none'}"),
        (arch.text_proj == ("linear" if clip else "linear_bias"), f"text projection {'linear' if clip else 'linear_bias'}"),
    ]
    return [what for ok, what in wanted if not ok]


def hf_family(model: VLModel, tokenizer: Tokenizer, name: str, cfg: JobConfig | None = None) -> str:
    """clip | siglip | siglip2 | blip: the transformers model ``model`` is the same math as, given the
    run's ``cfg`` (images at their own shape make it siglip2); a UserError says why none. A model with
    BLIP's text layers is blip, checked and written by :mod:`vltrain.export.hf_blip`."""
    refuse = f"{name} cannot be exported with --format hf"
    if isinstance(model.text, TextTransformer) and hf_blip.is_blip_layout(architecture_of(model)):
        return "blip"
    if model.fusion is not None:
        raise UserError(f"{refuse}: fusion models (ITM/MLM over a fusion encoder, ALBEF-style) have no Hugging "
                        "Face CLIPModel or SiglipModel equivalent; use --format native")
    if not isinstance(model.text, TextTransformer):
        raise UserError(f"{refuse}: its text tower is a Hugging Face encoder (model.text.hf_path), which "
                        "CLIPModel and SiglipModel do not have; use --format native")
    arch = architecture_of(model)
    if cfg is not None and cfg.data.at_own_shape():
        _check_native(arch, cfg, refuse)
        check_siglip2_tokenizer(model, tokenizer, cfg, refuse)
        return "siglip2"
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


def _check_native(arch: Architecture, cfg: JobConfig, refuse: str) -> None:
    """Images at their own shape are transformers' only in SigLIP 2's Siglip2Model, whose image
    processor always resizes an image to the largest grid within its patch budget."""
    missing = _differences(arch, "siglip")
    if missing:
        raise UserError(f"{refuse}: it reads images at their own shape (data.resize native), which transformers "
                        f"does only in SigLIP 2's Siglip2Model, and its architecture is not SigLIP's (Siglip2Model "
                        f"needs {'; '.join(missing)}); use --format native")
    if not cfg.data.upscale:
        floor = f", at least data.min_patches {cfg.data.min_patches}" if cfg.data.min_patches > 1 else ""
        raise UserError(f"{refuse}: data.upscale is false (small images kept at their own size{floor}), and "
                        "transformers' Siglip2ImageProcessor enlarges every image to fill max_num_patches: it "
                        "would show the model other images than training did; use --format native")


PROBES = ("a photo of a dog", "Two RED circles, left of a blue square.", "  spaces\tand\nlines  ", "café naïve 3.14?")
"""Captions the exported tokenizer must read as vltrain's does (with one cut at the length limit)."""


def check_siglip2_tokenizer(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, refuse: str) -> None:
    """Refuse a tokenizer transformers would read differently in a Siglip2Model folder.

    transformers 5 loads such a folder's tokenizer as its Siglip2Tokenizer whatever class
    tokenizer_config.json names: Gemma's BPE rebuilt from tokenizer.json's vocabulary and merges
    (lower-cased, spaces as "▁", byte fallback), keeping only its post-processor. SigLIP 2's own
    tokenizer survives that and most others do not, so the folder's text files are written to a
    scratch folder, loaded with AutoTokenizer and compared on a few captions before anything is
    exported. Text is padded to the fixed length with the model's pad id, without a mask, as trained.
    """
    try:
        import transformers
    except ImportError:
        raise UserError(f"{refuse}: a Siglip2Model folder's tokenizer is checked with transformers, which is not "
                        "installed: pip install 'vltrain[hf]'") from None
    length, pad = cfg.data.max_text_length, architecture_of(model).text.pad_id
    probes = [*PROBES, " ".join([PROBES[0]] * length)]
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its warnings about Siglip2TextConfig's own defaults mislead here
    with tempfile.TemporaryDirectory() as scratch:
        _write_files(Path(scratch), model, tokenizer, cfg, "siglip2")
        try:
            theirs = transformers.AutoTokenizer.from_pretrained(scratch)(probes, padding="max_length", truncation=True)
        except Exception as e:  # a tokenizer Siglip2Tokenizer cannot rebuild: the same verdict
            raise UserError(f"{refuse}: transformers cannot load its tokenizer as a Siglip2Tokenizer ({e}); use "
                            "--format native") from None
        finally:
            transformers.logging.set_verbosity(verbosity)
    for text, got in zip(probes, theirs["input_ids"]):
        ids = tokenizer.encode(text, length)[0]
        want = ids + [pad] * (length - len(ids))
        if got != want:
            shown = text if len(text) <= 40 else text[:40] + "..."
            cased = ("" if tokenizer.lowercases() or tokenizer.clean == "lower" else
                     ": vltrain's keeps case, and SigLIP 2 reads lower-cased text (train with data.text_clean=lower, "
                     "as model.init of a Siglip2Model folder does)")
            raise UserError(f"{refuse}: transformers reads a Siglip2Model folder's tokenizer as its Siglip2Tokenizer "
                            f"(Gemma's BPE, lower-cased), which encodes {shown!r} as {_head(got)} where vltrain's "
                            f"tokenizer ({tokenizer.path}) gives {_head(want)}{cased}; use --format native")


def _head(ids: list[int], n: int = 12) -> str:
    return str(ids[:n])[:-1] + ", ...]" if len(ids) > n else str(ids)


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
    """config.json; SigLIP 2 sizes its position table in patches (a square grid), not in pixels."""
    arch = architecture_of(model)
    v = arch.vision
    size = ({"num_patches": (v.image_size // v.patch_size) ** 2} if family == "siglip2" else
            {"image_size": v.image_size})
    vision = {"model_type": f"{family}_vision_model", "hidden_size": v.width,
              "intermediate_size": round(v.width * v.mlp_ratio), "num_hidden_layers": v.depth,
              "num_attention_heads": v.heads, **size, "patch_size": v.patch_size, "num_channels": 3,
              "hidden_act": HF_ACT[v.act], "layer_norm_eps": v.norm_eps}
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
    if family == "siglip2":  # each image to the largest grid of patches within the budget, as data/native.py
        return {"image_processor_type": "Siglip2ImageProcessor", "do_resize": True, "patch_size": d.patch_size,
                "max_num_patches": d.max_patches, "resample": RESAMPLE[d.interpolation], "do_rescale": True,
                "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": list(d.mean),
                "image_std": list(d.std), "do_convert_rgb": True}
    crop = d.resize == "crop"
    return {"image_processor_type": "SiglipImageProcessor" if family == "siglip" and not crop else "CLIPImageProcessor",
            "do_resize": True, "size": {"shortest_edge": s} if crop else {"height": s, "width": s},
            "do_center_crop": crop, **({"crop_size": {"height": s, "width": s}} if crop else {}),
            "resample": RESAMPLE[d.interpolation], "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(d.mean), "image_std": list(d.std), "do_convert_rgb": True}


def tokenizer_config(tokenizer: Tokenizer, cfg: JobConfig, pad_id: int, family: str = "clip") -> dict:
    """The tokenizer.json as it is (PreTrainedTokenizerFast), with its special tokens named.

    SigLIP 2: transformers 5 reads it as a Siglip2Tokenizer whatever class is named here
    (:func:`check_siglip2_tokenizer`), which pads left, returns an attention mask and names Gemma's
    special tokens unless told otherwise; the model was trained padded right to the fixed length
    without a mask, and a special token this tokenizer lacks is written null rather than added."""
    name = tokenizer.hf.id_to_token
    out = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.data.max_text_length,
           "pad_token": name(pad_id)}
    specials = {"bos_token": tokenizer.cls_id, "eos_token": tokenizer.eos_id, "mask_token": tokenizer.mask_id}
    if family == "siglip2":
        unk = getattr(tokenizer.hf.model, "unk_token", None)
        return {**out, "padding_side": "right", "model_input_names": ["input_ids"], "unk_token": unk,
                **{key: None if i is None else name(i) for key, i in specials.items()}}
    return {**out, **{key: name(i) for key, i in specials.items() if i is not None}}


def write_hf(model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, out: Path, family: str,
             metadata: dict[str, str]) -> list[str]:
    """Write the folder; returns notes for the user (heads left out)."""
    arch = architecture_of(model)
    state = model.state_dict()
    links = [link for link in hf_clip.links(arch, family) if link.ours in state]
    tensors = convert_out(links, state)
    notes = []
    if family != "clip" and "logit_bias" not in tensors:
        tensors["logit_bias"] = torch.zeros(1)
        notes.append("the model has no SigLIP logit bias (model.loss.siglip_bias false): written as 0")
    left = sorted({k.split(".", 1)[0] for k in state if k not in {link.ours for link in links}})
    if left:
        notes.append(f"left out (transformers' {hf_clip.FAMILIES[family]} has no place for them): {', '.join(left)}")
    write_weights(out / "model.safetensors", tensors, metadata)
    _write_files(out, model, tokenizer, cfg, family)
    return notes


def _write_files(out: Path, model: VLModel, tokenizer: Tokenizer, cfg: JobConfig, family: str) -> None:
    """Everything but the weights: config.json, the image processor's, the tokenizer and its config."""
    pad_id = tokenizer.pad_id if family == "clip" else architecture_of(model).text.pad_id
    files = {"config.json": hf_config(model, tokenizer, family),
             "preprocessor_config.json": preprocessor_config(cfg, family),
             "tokenizer_config.json": tokenizer_config(tokenizer, cfg, pad_id, family)}
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2) + "\n")
    tokenizer.save(out / "tokenizer.json")
