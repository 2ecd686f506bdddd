"""``build_model``: a ``ModelConfig`` (preset, overrides, objectives) to a ``VLModel``.

Which parts a model has is decided here and only here: a fusion encoder when the preset has one and
ITM or MLM is on, an ITM or MLM head when its weight is > 0, a SigLIP bias when SigLIP is on, a
captioning decoder when the preset has one and the caption loss is on. The
objectives (:mod:`vltrain.objectives.scoring`) then run exactly the heads the model has.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from vltrain.boxes import BOX_TOKENS
from vltrain.errors import ConfigError, UserError
from vltrain.model.config import LossConfig, ModelConfig, SelfDistSettings
from vltrain.model.decoder import CaptionDecoder
from vltrain.model.fusion import FusionEncoder
from vltrain.model.heads import ITMHead, MIMHead, MLMHead, Projection
from vltrain.model.selfdist import HeadSettings, SelfDistHeads
from vltrain.model.locca import LocCaDecoder
from vltrain.model.model import VLModel
from vltrain.model.presets import Architecture
from vltrain.model.text import HFTextEncoder, TextTransformer
from vltrain.model.vision import VisionTransformer


def _text_tower(model_cfg: ModelConfig, arch: Architecture, vocab_size: int, max_text_length: int,
                image_width: int = 0) -> nn.Module:
    """``image_width``: the tower's layers also cross-attend to image tokens of that width (a shared fusion)."""
    pooling = model_cfg.text.pooling
    fixed_length = arch.text.pad_to_max_length and not model_cfg.text.hf_path
    if (pooling or arch.text.pooling) == "last" and not fixed_length:
        # the last position of a batch padded to its longest caption: it moves with the batch,
        # so the same caption would embed differently with other rows, ranks or micro-batches
        raise ConfigError("model.text.pooling: last reads the last position, which is padding unless every "
                          "caption is padded to one length (a SigLIP checkpoint's tower does so); use eos, mean "
                          "or first")
    if not model_cfg.text.hf_path:
        pooling = pooling or arch.text.pooling
        return TextTransformer(replace(arch.text, vocab_size=vocab_size, max_length=max_text_length, pooling=pooling,
                                       layout=model_cfg.text.layout, pack_multiple=model_cfg.text.pack_multiple),
                               image_width)
    if pooling == "appended":
        raise ConfigError("model.text.pooling: appended (an appended class token) is for vltrain's own text tower, "
                          "not model.text.hf_path; use first, eos or mean")
    text = HFTextEncoder(model_cfg.text.hf_path, pooling or "first", max_text_length)
    if vocab_size > text.token_embedding.num_embeddings:
        raise UserError(
            f"tokenizer vocabulary {vocab_size} exceeds {model_cfg.text.hf_path}'s embeddings "
            f"{text.token_embedding.num_embeddings}; use the folder's own tokenizer.json"
        )
    return text


def has_fusion(arch: Architecture, loss: LossConfig) -> bool:
    """Whether a model of ``arch`` trained on ``loss`` gets its fusion encoder: the architecture has
    one and ITM or MLM is on."""
    return arch.fusion is not None and (loss.itm > 0 or loss.mlm > 0)


def has_decoder(arch: Architecture, loss: LossConfig) -> bool:
    """Whether a model of ``arch`` trained on ``loss`` gets its captioning decoder: the architecture
    has one and the caption loss is on."""
    if arch.decoder is None:
        return False
    return loss.caption > 0 or (arch.decoder.standalone and (loss.referring > 0 or loss.grounded_caption > 0))


def _check_decoder(model_cfg: ModelConfig, arch: Architecture) -> None:
    """A decoder reads the text tower's tokens as a language model: they must not see ahead."""
    if model_cfg.text.hf_path:
        raise ConfigError("model.text.hf_path: a Hugging Face encoder sees the whole caption, so a captioning "
                          "decoder on it would read the tokens it predicts; use the preset's own text tower, or "
                          "set model.loss.caption=0")
    if not arch.text.causal:
        raise ConfigError(f"{model_cfg.preset or 'model.arch'}: a captioning decoder needs a causal text tower "
                          "(text.causal), or it would read the tokens it predicts; set model.loss.caption=0")


def _decoder(model_cfg: ModelConfig, arch: Architecture, text: nn.Module, image_width: int, vocab_size: int,
             max_text_length: int) -> CaptionDecoder | None:
    """The captioning decoder (CoCa's, over the text tower's tokens), LocCa's, or None."""
    if not has_decoder(arch, model_cfg.loss):
        return None
    if arch.decoder.standalone:  # its longest row: the task token, a phrase (a caption's length at most), a box
        return LocCaDecoder(arch.decoder, text.width, image_width, vocab_size, max_text_length + 1 + BOX_TOKENS)
    _check_decoder(model_cfg, arch)
    return CaptionDecoder(arch.decoder, text.width, image_width, vocab_size, text.token_embedding)


def _check_shared(model_cfg: ModelConfig, arch: Architecture) -> None:
    """A shared fusion reruns the text tower's own post-norm layers, and hands on its embedded tokens."""
    if model_cfg.text.hf_path or not arch.text.post_norm:
        raise ConfigError("a shared fusion (BLIP's) runs the text tower's own post-norm layers with their "
                          "cross-attention: it needs vltrain's text tower with text.post_norm, not model.text.hf_path")
    if model_cfg.loss.text_mlm > 0:
        raise ConfigError("model.loss.text_mlm reads the text tower's output, and a tower under a shared fusion "
                          "(BLIP's text encoder) hands on its embedded tokens instead; set model.loss.text_mlm=0")


def _check_heads(arch: Architecture, loss: LossConfig, fused: bool, mask_id: int | None) -> None:
    """The objectives' heads need what they read: a mask token for MLM, patch tokens for MIM."""
    for key, on in (("mlm", fused and loss.mlm > 0), ("text_mlm", loss.text_mlm > 0)):
        if on and mask_id is None:
            raise UserError(f"model.loss.{key} > 0 needs a tokenizer with a mask token; set model.loss.{key}=0 or use one")
    if loss.image_mim > 0 and arch.vision.pooling == "attn_pool":
        raise ConfigError("model.loss.image_mim > 0: masked image modelling predicts each patch from its token, and "
                          "an attentional pooler's tokens are not patches; set model.loss.image_mim=0")


def build_model(
    model_cfg: ModelConfig,
    *,
    vocab_size: int,
    pad_id: int,
    mask_id: int | None,
    image_size: int,
    max_text_length: int,
) -> VLModel:
    """The preset's architecture (or ``model.arch``, the one ``model.init`` read from its checkpoint)
    at the data's image size and the tokenizer's vocabulary.

    ``model.text.hf_path`` swaps the text tower for a local Hugging Face encoder; ``model.text.pooling``
    and ``model.embed_dim`` override the preset's; objectives the architecture has no head for
    (ITM, MLM on a dual encoder) are ignored. Parts are created in a fixed order (towers, fusion,
    projections, heads), so a seed gives the same initial weights.
    """
    model_cfg.validate()  # a config built in code has not been through load_config
    arch = model_cfg.architecture()
    if image_size % arch.vision.patch_size:
        raise ConfigError(
            f"image size {image_size} is not a multiple of {model_cfg.preset or 'the architecture'}'s patch size "
            f"{arch.vision.patch_size}"
        )
    loss = model_cfg.loss
    fused = has_fusion(arch, loss)
    _check_heads(arch, loss, fused, mask_id)
    vision = VisionTransformer(replace(arch.vision, image_size=image_size))
    shared = fused and arch.fusion.shared
    if shared:
        _check_shared(model_cfg, arch)
    text = _text_tower(model_cfg, arch, vocab_size, max_text_length, vision.width if shared else 0)
    fusion = FusionEncoder(arch.fusion, text.width, vision.width, text) if fused else None
    decoder = _decoder(model_cfg, arch, text, vision.width, vocab_size, max_text_length)
    embed_dim = model_cfg.embed_dim or arch.embed_dim
    image_proj = Projection(vision.width, embed_dim, arch.image_proj)
    text_proj = Projection(text.width, embed_dim, arch.text_proj)
    siglip_only = loss.siglip > 0 and loss.itc == 0
    return VLModel(
        vision,
        text,
        image_proj,
        text_proj,
        logit_scale=math.log(10.0) if siglip_only else math.log(1 / 0.07),
        logit_bias=-10.0 if loss.siglip > 0 and loss.siglip_bias else None,
        fusion=fusion,
        itm_head=ITMHead(fusion.width) if fused and loss.itm > 0 else None,
        mlm_head=MLMHead(text.width, text.token_embedding) if fused and loss.mlm > 0 else None,
        text_mlm_head=MLMHead(text.width, text.token_embedding) if loss.text_mlm > 0 else None,
        mim_head=MIMHead(vision.width, arch.vision.patch_size) if loss.image_mim > 0 else None,
        decoder=decoder,
        selfdist=_selfdist_heads(model_cfg.selfdist, vision.width),
        vocab_size=vocab_size,
        pad_id=pad_id,
        mask_id=mask_id,
        max_text_length=max_text_length,
    )


def _selfdist_heads(settings: SelfDistSettings, width: int) -> SelfDistHeads | None:
    """SILC's and TIPS's heads, last of the parts (the weights made before them stay as they were)."""
    if not settings.heads:
        return None
    return SelfDistHeads(width, HeadSettings(settings.prototypes, settings.hidden, settings.bottleneck))


def count_parameters(model_cfg: ModelConfig, *, vocab_size: int, image_size: int, max_text_length: int) -> int:
    """Parameters of a preset, built on the meta device (instant, no memory, even for ViT-L)."""
    with torch.device("meta"):
        model = build_model(
            model_cfg, vocab_size=vocab_size, pad_id=0, mask_id=1, image_size=image_size, max_text_length=max_text_length
        )
    return sum(p.numel() for p in model.parameters())
