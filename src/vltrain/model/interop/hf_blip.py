"""Hugging Face BLIP folders (``BlipForConditionalGeneration``, ``BlipForImageTextRetrieval``): their
architecture, preprocessing and weights.

BLIP's parts are options of vltrain's modules, so the same weights compute the same function:

- the vision tower is a pre-norm ViT with a class token and a biased patch embedding, no norm before
  its blocks and a norm after them (``post_layernorm``); q, k and v in one ``qkv`` matrix, as ours;
- the text models are BERT: word and position embeddings with a norm (``TextTowerConfig.embed_norm``),
  post-norm layers (:class:`vltrain.model.blocks.PostNormBlock`) whose cross-attention reads the
  image tokens, and BERT's LM head (``DecoderConfig.head`` transform), tied to the word embeddings
  or not as ``tie_word_embeddings`` says;
- the captioner's decoder is BERT's embeddings (a text tower without layers) under post-norm decoder
  layers, and reads its [DEC] token (``bos_token_id``) at position 0 (``TextTowerConfig.start_id``):
  transformers' ``generate`` starts there and stops at ``sep_token_id``;
- the retrieval model's one text encoder encodes text alone for ITC (pooled at [CLS], projected with a
  bias) and, its layers' cross-attention reading the image, fuses it for ITM: a text tower of
  post-norm layers under a shared fusion (``FusionConfig.shared``), whose pass reruns those layers
  from the embedded tokens. transformers feeds the ITM pass the ids as given, [CLS] first (BLIP's
  original code put [ENC] there), and so does vltrain.

A captioner has no contrastive parts: its projections and temperature start fresh, and the run
trains the caption loss alone unless ``model.loss`` says otherwise. Neither folder keeps BLIP's
temperature: it starts at vltrain's (and BLIP's) 0.07.

``config.json`` may leave out values equal to transformers' defaults, so those defaults are here.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from vltrain.errors import UserError
from vltrain.model.decoder import DecoderConfig
from vltrain.model.fusion import FusionConfig
from vltrain.model.interop.convert import OPENAI_MEAN, OPENAI_STD, Link, Preprocessing, linear, same
from vltrain.model.interop.hf_clip import ACTIVATIONS, image_processor, square_images
from vltrain.model.presets import Architecture
from vltrain.model.text import TextTowerConfig
from vltrain.model.vision import VisionConfig

VARIANTS = {"BlipForConditionalGeneration": "caption", "BlipForImageTextRetrieval": "retrieval"}
"""The transformers classes vltrain reads, and what each is for."""
DEFAULTS: dict[str, dict[str, Any]] = {
    "text": {"vocab_size": 30524, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
             "num_attention_heads": 8, "max_position_embeddings": 512, "hidden_act": "gelu", "layer_norm_eps": 1e-12,
             "bos_token_id": 30522, "pad_token_id": 0, "sep_token_id": 102, "tie_word_embeddings": True},
    "vision": {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
               "image_size": 384, "patch_size": 16, "hidden_act": "gelu", "layer_norm_eps": 1e-5},
    "": {"image_text_hidden_size": 256, "tie_word_embeddings": True},
}
"""transformers' defaults (BlipTextConfig, BlipVisionConfig, BlipConfig) for the values a config.json may omit."""
IGNORED = ("position_ids",)
"""Buffers older transformers saved with the weights; they hold no weights."""
HEAD = "text_decoder.cls.predictions."
WORDS = "text_decoder.bert.embeddings.word_embeddings.weight"


def is_blip(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "blip"


def variant_of(config: dict[str, Any], folder: Path) -> str:
    """caption | retrieval: what the folder's model class is for; a UserError for the others."""
    names = config.get("architectures") or []
    name = names[0] if names else ""
    if name in VARIANTS:
        return VARIANTS[name]
    known = " and ".join(VARIANTS)
    if not name:
        raise UserError(f"{folder}/config.json names no model class (its \"architectures\" is empty): vltrain reads "
                        f"{known} folders; save the model with save_pretrained, which writes it")
    raise UserError(f"{folder}/config.json is a {name}, which vltrain does not support: it reads {known} folders "
                    "(captioning, and retrieval with image-text matching)")


def _part(config: dict[str, Any], side: str) -> dict[str, Any]:
    """``config``'s text or vision part, or itself (``side`` ""), over transformers' defaults."""
    given = config.get(f"{side}_config") or {} if side else config
    if not isinstance(given, dict):
        raise UserError(f"{side}_config in a BLIP config.json must be a mapping, got {type(given).__name__}")
    return {**DEFAULTS[side], **given}


def _int(part: dict[str, Any], key: str, where: str) -> int:
    value = part.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise UserError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _sizes(part: dict[str, Any], where: str) -> dict[str, Any]:
    """A tower's width, depth, heads, MLP ratio, activation and norm eps, checked."""
    width, heads = _int(part, "hidden_size", where), _int(part, "num_attention_heads", where)
    if heads <= 0 or width % heads:
        raise UserError(f"{where}: hidden_size {width} is not a multiple of num_attention_heads {heads}")
    act = part.get("hidden_act")
    if act not in ACTIVATIONS:
        raise UserError(f"{where}: hidden_act {act!r} is not one vltrain has ({', '.join(ACTIVATIONS)})")
    return {"width": width, "heads": heads, "depth": _int(part, "num_hidden_layers", where),
            "mlp_ratio": _int(part, "intermediate_size", where) / width, "act": ACTIVATIONS[act],
            "norm_eps": float(part["layer_norm_eps"])}


def tied(config: dict[str, Any]) -> bool:
    """Whether the LM head's weight and bias are the word embeddings' and the prediction bias
    (transformers ties them when the model's or the text model's config says so)."""
    return bool(_part(config, "")["tie_word_embeddings"] or _part(config, "text")["tie_word_embeddings"])


def architecture(folder: Path, config: dict[str, Any]) -> Architecture:
    """The :class:`Architecture` transformers builds from a BLIP ``config.json``."""
    variant = variant_of(config, folder)
    where = f"{folder}/config.json"
    v, t = _part(config, "vision"), _part(config, "text")
    vision = VisionConfig(image_size=_int(v, "image_size", f"{where} vision_config"),
                          patch_size=_int(v, "patch_size", f"{where} vision_config"), pre_norm=False, patch_bias=True,
                          **_sizes(v, f"{where} vision_config"))
    if vision.image_size % vision.patch_size:
        raise UserError(f"{where}: vision_config.image_size {vision.image_size} is not a multiple of its patch_size "
                        f"{vision.patch_size}")
    sizes = _sizes(t, f"{where} text_config")
    text = TextTowerConfig(vocab_size=_int(t, "vocab_size", f"{where} text_config"),
                           max_length=_int(t, "max_position_embeddings", f"{where} text_config"), pooling="first",
                           embed_norm=True, post_norm=True, pad_id=_int(t, "pad_token_id", f"{where} text_config"),
                           **sizes)
    embed_dim = _int(_part(config, ""), "image_text_hidden_size", where)
    if variant == "retrieval":  # one text encoder for ITC, and with its cross-attention for ITM
        if not t.get("is_decoder", True):
            raise UserError(f"{where}: text_config.is_decoder is false, so its text encoder has no cross-attention "
                            "layers and BlipForImageTextRetrieval's image-text matching reads no image")
        fusion = FusionConfig(depth=sizes["depth"], heads=sizes["heads"], mlp_ratio=sizes["mlp_ratio"], shared=True)
        return Architecture(vision, text, embed_dim, fusion, image_proj="linear_bias", text_proj="linear_bias")
    # the captioner: a text tower of BERT's embeddings alone, under the decoder's post-norm layers
    start = _int(t, "bos_token_id", f"{where} text_config")
    text = replace(text, depth=0, pooling="eos", causal=True, start_id=start)
    decoder = DecoderConfig(depth=sizes["depth"], heads=sizes["heads"], mlp_ratio=sizes["mlp_ratio"],
                            tied=tied(config), act=sizes["act"], post_norm=True, head="transform",
                            norm_eps=sizes["norm_eps"])
    return Architecture(vision, text, embed_dim, image_proj="linear_bias", text_proj="linear_bias", decoder=decoder)


def preprocessing(folder: Path, config: dict[str, Any], arch: Architecture) -> Preprocessing:
    """preprocessor_config.json's image size, filter and statistics (BLIP squashes images to a
    square); the folder's tokenizer, checked against the config's special tokens."""
    path, pp = image_processor(folder)
    notes = [] if pp else [f"{path.name} absent: BLIP's usual preprocessing assumed (bicubic, squashed to a square)"]
    images = square_images(pp, path, arch, "blip", notes)
    tokenizer = folder / "tokenizer.json"
    if tokenizer.is_file():
        notes += _token_notes(tokenizer, _part(config, "text"))
    return Preprocessing(
        image_size=arch.vision.image_size, mean=list(pp.get("image_mean", OPENAI_MEAN)),
        std=list(pp.get("image_std", OPENAI_STD)), max_text_length=arch.text.max_length,
        tokenizer=str(tokenizer) if tokenizer.is_file() else "",
        objective="caption" if arch.decoder is not None else "itc", notes=notes, **images,
    )


def _token_notes(path: Path, t: dict[str, Any]) -> list[str]:
    """Where the tokenizer's [PAD] and [SEP] differ from the ids the config names (vltrain pads with
    the tokenizer's and ends captions at its [SEP], as transformers does with the config's)."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(path))
    found = {"pad_token_id": tok.token_to_id("[PAD]"), "sep_token_id": tok.token_to_id("[SEP]")}
    return [f"{path.name} gives {key.removesuffix('_id')} {found[key]} where config.json says {t[key]}: the "
            "tokenizer's is used" for key in found if t.get(key) is not None and found[key] != t[key]]


def prepare(state: dict[str, torch.Tensor], arch: Architecture, source: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the links read them. A tied LM head's weight and bias are the word
    embeddings and the prediction bias: a copy saved under the head's own names (older saves did)
    must equal them, and is dropped. An untied head's ``cls.predictions.bias`` is never read by
    transformers (its ``decoder.bias`` is): dropped too."""
    out = dict(state)
    if arch.decoder is None:
        return out
    if not arch.decoder.tied:
        out.pop(f"{HEAD}bias", None)
        return out
    for copy, original in ((f"{HEAD}decoder.weight", WORDS), (f"{HEAD}decoder.bias", f"{HEAD}bias")):
        if copy in out and original in out and not torch.equal(out[copy], out[original]):
            raise UserError(f"{source}: tensor {copy!r} differs from {original!r}, and config.json ties the two "
                            "(tie_word_embeddings): the checkpoint contradicts its config")
        out.pop(copy, None)
    return out


def vision_links(arch: Architecture) -> list[Link]:
    """BLIP's vision model, tied to our vision tower."""
    v, w = "vision_model", arch.vision.width
    n = arch.vision.num_patches + 1
    out = [*linear("vision.patch_embed", f"{v}.embeddings.patch_embedding"),
           Link("vision.cls_token", (f"{v}.embeddings.class_embedding",), shape=(1, 1, w)),
           Link("vision.pos_embed", (f"{v}.embeddings.position_embedding",), shape=(1, n, w))]
    for i in range(arch.vision.depth):
        ours, theirs = f"vision.blocks.{i}", f"{v}.encoder.layers.{i}"
        out += [*linear(f"{ours}.norm1", f"{theirs}.layer_norm1"), *linear(f"{ours}.attn.qkv", f"{theirs}.self_attn.qkv"),
                *linear(f"{ours}.attn.out", f"{theirs}.self_attn.projection"),
                *linear(f"{ours}.norm2", f"{theirs}.layer_norm2"), *linear(f"{ours}.mlp.fc", f"{theirs}.mlp.fc1"),
                *linear(f"{ours}.mlp.proj", f"{theirs}.mlp.fc2")]
    return out + linear("vision.norm", f"{v}.post_layernorm")


def bert_layer_links(ours: str, theirs: str) -> list[Link]:
    """One BERT layer (``BlipTextLayer``) and our :class:`PostNormBlock`: its query, key and value
    become our ``qkv``, its cross-attention's key and value our ``kv``."""
    out = []
    for p in ("weight", "bias"):
        out += [Link(f"{ours}.attn.qkv.{p}", tuple(f"{theirs}.attention.self.{x}.{p}" for x in ("query", "key", "value"))),
                same(f"{ours}.cross.q.{p}", f"{theirs}.crossattention.self.query.{p}"),
                Link(f"{ours}.cross.kv.{p}", tuple(f"{theirs}.crossattention.self.{x}.{p}" for x in ("key", "value")))]
    return out + [*linear(f"{ours}.attn.out", f"{theirs}.attention.output.dense"),
                  *linear(f"{ours}.attn_norm", f"{theirs}.attention.output.LayerNorm"),
                  *linear(f"{ours}.cross.out", f"{theirs}.crossattention.output.dense"),
                  *linear(f"{ours}.cross_norm", f"{theirs}.crossattention.output.LayerNorm"),
                  *linear(f"{ours}.mlp.fc", f"{theirs}.intermediate.dense"),
                  *linear(f"{ours}.mlp.proj", f"{theirs}.output.dense"),
                  *linear(f"{ours}.mlp_norm", f"{theirs}.output.LayerNorm")]


def _embedding_links(theirs: str) -> list[Link]:
    return [same("text.token_embedding.weight", f"{theirs}.word_embeddings.weight"),
            same("text.pos_embed", f"{theirs}.position_embeddings.weight"),
            *linear("text.embed_norm", f"{theirs}.LayerNorm")]


def links(arch: Architecture) -> list[Link]:
    """Every tensor of the folder's model (after :func:`prepare`), tied to ours."""
    if arch.decoder is None:  # BlipForImageTextRetrieval
        out = vision_links(arch) + _embedding_links("text_encoder.embeddings")
        for i in range(arch.text.depth):
            out += bert_layer_links(f"text.blocks.{i}", f"text_encoder.encoder.layer.{i}")
        return out + [*linear("image_proj.proj", "vision_proj"), *linear("text_proj.proj", "text_proj"),
                      *linear("itm_head.fc", "itm_head")]
    out = vision_links(arch) + _embedding_links("text_decoder.bert.embeddings")
    d = arch.decoder
    for i in range(d.depth):
        out += bert_layer_links(f"decoder.blocks.{i}", f"text_decoder.bert.encoder.layer.{i}")
    out += [*linear("decoder.head.dense", f"{HEAD}transform.dense"),
            *linear("decoder.head.norm", f"{HEAD}transform.LayerNorm")]
    if d.tied:
        return out + [same("decoder.head.bias", f"{HEAD}bias")]
    return out + [same("decoder.head.bias", f"{HEAD}decoder.bias"), same("decoder.head.decoder.weight",
                                                                        f"{HEAD}decoder.weight")]


def parts(arch: Architecture) -> tuple[str, ...]:
    """The prefixes of our tensors the checkpoint must give (the rest, the temperature included, start
    fresh: BLIP's folders keep none)."""
    if arch.decoder is None:
        return ("vision.", "text.", "image_proj.", "text_proj.", "itm_head.")
    return ("vision.", "text.", "decoder.")



def is_blip_layout(arch: Architecture) -> bool:
    """Whether ``arch`` has BLIP's BERT text (post-norm layers), which only a BLIP folder can hold."""
    return arch.text.post_norm or (arch.decoder is not None and arch.decoder.post_norm)


def class_of(arch: Architecture) -> str:
    """The transformers class a model of BLIP's ``arch`` is written as: the captioner, or retrieval."""
    return "BlipForConditionalGeneration" if arch.decoder is not None else "BlipForImageTextRetrieval"


def exportable(arch: Architecture) -> str:
    """What keeps a model of ``arch`` from being :func:`class_of`'s class ("" when nothing)."""
    v, t, d, f = arch.vision, arch.text, arch.decoder, arch.fusion
    checks = [(v.class_token and not v.pre_norm and v.patch_bias and v.pooling == "cls",
               "a ViT with a class token, a biased patch embedding and no norm before its blocks")]
    if d is None:  # retrieval: one BERT text encoder, fused with the image by its own layers
        return "; ".join(what for ok, what in checks + [
            (f is not None and f.shared, "image-text matching by the text encoder's own layers (a shared fusion, "
                                         "with model.loss.itm > 0)"),
            (t.embed_norm and t.post_norm and not t.causal and t.pooling == "first" and t.start_id is None,
             "a bidirectional BERT text encoder pooled at its first token"),
            (arch.image_proj == arch.text_proj == "linear_bias", "projections with a bias"),
        ] if not ok)
    checks += [
        (d.post_norm and d.head == "transform", "a captioning decoder of post-norm layers with BERT's LM head "
                                                "(decoder head transform)"),
        (t.depth == 0 and t.embed_norm and t.post_norm and t.causal and t.start_id is not None,
         "a text tower of normed embeddings alone, reading its own start token"),
        (d.norm_eps == t.norm_eps, "one layer-norm eps for the text's embeddings and layers"),
        (f is None, "no fusion encoder"),
    ]
    return "; ".join(what for ok, what in checks if not ok)


def join(tensors: dict[str, torch.Tensor], arch: Architecture) -> dict[str, torch.Tensor]:
    """The reverse of :func:`prepare`: an untied head's ``cls.predictions.bias``, which transformers
    keeps but never reads, written as the bias it reads."""
    out = dict(tensors)
    if arch.decoder is not None and not arch.decoder.tied:
        out[f"{HEAD}bias"] = out[f"{HEAD}decoder.bias"].clone()
    return out


def model_config(arch: Architecture, vocab_size: int, positions: int, tokens: dict[str, int | None],
                 hf_act: dict[str, str]) -> dict[str, Any]:
    """The ``config.json`` of :func:`class_of`'s class of ``arch``; ``tokens``: bos, sep and pad ids
    (``*_token_id``); ``hf_act``: our activations' names in transformers."""
    v, t, d = arch.vision, arch.text, arch.decoder
    layers = d if d is not None else t  # where the text's layers are: the decoder's, or the encoder's own
    vision = {"model_type": "blip_vision_model", "hidden_size": v.width, "intermediate_size": round(v.width * v.mlp_ratio),
              "num_hidden_layers": v.depth, "num_attention_heads": v.heads, "image_size": v.image_size,
              "patch_size": v.patch_size, "hidden_act": hf_act[v.act], "layer_norm_eps": v.norm_eps}
    tied = d is not None and d.tied
    text = {"model_type": "blip_text_model", "vocab_size": vocab_size, "hidden_size": t.width,
            "encoder_hidden_size": v.width, "intermediate_size": round(t.width * layers.mlp_ratio),
            "num_hidden_layers": layers.depth, "num_attention_heads": layers.heads,
            "max_position_embeddings": positions, "hidden_act": hf_act[layers.act], "layer_norm_eps": layers.norm_eps,
            "eos_token_id": tokens["sep_token_id"], **tokens, "is_decoder": True, "tie_word_embeddings": tied}
    return {"architectures": [class_of(arch)], "model_type": "blip", "image_text_hidden_size": arch.embed_dim,
            "tie_word_embeddings": tied, "text_config": text, "vision_config": vision}
