"""The captioning decoder (CoCa's multimodal text decoder): causal transformer blocks over the text
tower's tokens that also cross-attend to the image tokens, then a norm and a map to the vocabulary.

The text tower under it must be causal (``TextTowerConfig.causal``): its tokens at position ``t``
then see the caption up to ``t`` only, and the decoder's logits at ``t`` predict token ``t + 1``.

A row without an image (text-only data) reads no image: its cross-attention output is multiplied by
zero, so the decoder is a plain causal language model on it and no image parameter is trained by
it, while every row still runs the same modules (every rank runs the same graph). The image tokens
come with their mask (:class:`vltrain.types.Tokens`), so images at their own shape, padded or
packed, and patch dropout's kept tokens all work.

Generation runs the text tower's blocks and the decoder's one position at a time on cached keys
and values (:class:`DecoderCache`): each block's self-attention keys and values of the positions so
far, and each decoder block's cross-attention keys and values of the image tokens, computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.model.blocks import (
    MLP,
    Block,
    CrossAttention,
    CrossBlock,
    LayerCache,
    LayerNorm,
    PostNormBlock,
    block_flops,
    key_padding_mask,
    mlp_width,
    run_blocks,
)
from vltrain.model.heads import MLMHead
from vltrain.types import Tokens


@dataclass
class DecoderConfig:
    depth: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    tied: bool = False
    """Map to the vocabulary with the text tower's token embedding (tied) instead of a matrix of its own."""
    act: str = "gelu"
    """MLP activation: gelu | gelu_tanh | quick_gelu (``vltrain.model.blocks.ACTIVATIONS``)."""
    separate_cross: bool = False
    """Each layer two residual blocks, as OpenCLIP's CoCa decoder has them (``SplitDecoderBlock``):
    causal self-attention with a feed-forward, then cross-attention with a feed-forward of its own
    and a layer norm on the image tokens. False: one block of self-attention, cross-attention and
    one feed-forward (``DecoderBlock``)."""
    post_norm: bool = False
    """BERT's layers, as BLIP's text decoder has them (:class:`vltrain.model.blocks.PostNormBlock`):
    self-attention, cross-attention and feed-forward, each sublayer's residual then its norm, and
    no norm after the last layer."""
    head: str = "linear"
    """How the vocabulary's logits are made: linear (a map, tied or its own) | transform (BERT's LM
    head: a dense layer, the activation and a norm, then the map plus a bias per token)."""
    norm_eps: float = 1e-5
    """eps of the post-norm layers' norms and of the transform head's."""
    standalone: bool = False
    """LocCa's decoder (SigLIP 2, :class:`vltrain.model.locca.LocCaDecoder`): it embeds token ids itself
    (token and position embeddings of its own) instead of reading a causal text tower's tokens, and
    its vocabulary adds ``box_bins`` box tokens and four task tokens to the tokenizer's. It trains
    captions, referring expressions and grounded captions, each causal or all tokens at once."""
    box_bins: int = 1000
    """A standalone decoder's box tokens: the bins each box coordinate is quantized into (LocCa's and
    Pix2Seq's 1,000)."""


HEADS = ("linear", "transform")


@dataclass
class DecoderCache:
    """What generation keeps between positions: the text tower's and the decoder's cached keys and
    values (one :class:`LayerCache` per block), the image tokens until the first step has made
    their keys and values, their mask (attention form) and the rows' gate."""

    text: list[LayerCache]
    layers: list[LayerCache]
    image: torch.Tensor | None
    image_mask: torch.Tensor | None
    gate: torch.Tensor
    length: int = 0
    """The positions cached so far."""

    @staticmethod
    def empty(text_depth: int, depth: int, image: Tokens, has_image: torch.Tensor) -> "DecoderCache":
        return DecoderCache([LayerCache() for _ in range(text_depth)], [LayerCache() for _ in range(depth)],
                            image.values, image.cross_mask, has_image.to(image.values.dtype)[:, None, None])

    def select(self, index: torch.Tensor) -> "DecoderCache":
        """The cache of rows ``index`` (beam search keeps its best beams)."""
        def rows(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.index_select(0, index)

        return DecoderCache([c.select(index) for c in self.text], [c.select(index) for c in self.layers],
                            rows(self.image), rows(self.image_mask), rows(self.gate), self.length)


class DecoderBlock(CrossBlock):
    """A fusion block's layers (causal self-attention, cross-attention to the image tokens,
    feed-forward; pre-norm residuals), with the cross-attention gated per row and a cache for
    generation."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | LayerCache, image: torch.Tensor | None,
                image_mask: torch.Tensor | None, gate: torch.Tensor) -> torch.Tensor:
        """``gate`` [B, 1, 1]: 1 where the row has an image, 0 where its cross-attention reads none.
        ``mask`` a :class:`LayerCache` in generation: ``x`` holds the new positions (the cache,
        through ``forward``, so that FSDP2 gathers the block's parameters as in training)."""
        cache = mask if isinstance(mask, LayerCache) else None
        x = x + self.attn(self.norm1(x), mask)
        x = x + gate * self.cross(self.norm2(x), image, image_mask, cache)
        return x + self.mlp(self.norm3(x))


class ImageBlock(nn.Module):
    """Cross-attention to the (normed) image tokens, gated per row, then a feed-forward; pre-norm
    residuals. The second half of a :class:`SplitDecoderBlock`."""

    def __init__(self, width: int, heads: int, image_width: int, mlp_ratio: float, act: str):
        super().__init__()
        self.norm1 = LayerNorm(width)
        self.norm_image = LayerNorm(image_width)
        self.cross = CrossAttention(width, heads, image_width)
        self.norm2 = LayerNorm(width)
        self.mlp = MLP(width, mlp_width(width, mlp_ratio), act)

    def forward(self, x: torch.Tensor, image: torch.Tensor | None, image_mask: torch.Tensor | None,
                gate: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """``image`` None in generation once ``cache`` holds its keys and values."""
        image = None if image is None else self.norm_image(image)
        x = x + gate * self.cross(self.norm1(x), image, image_mask, cache)
        return x + self.mlp(self.norm2(x))


class SplitDecoderBlock(nn.Module):
    """One layer of OpenCLIP's CoCa decoder: a causal self-attention :class:`Block` (its own
    feed-forward), then an :class:`ImageBlock`. Called as :class:`DecoderBlock` is."""

    def __init__(self, width: int, heads: int, image_width: int, mlp_ratio: float, act: str):
        super().__init__()
        self.text = Block(width, heads, mlp_ratio, act)
        self.image = ImageBlock(width, heads, image_width, mlp_ratio, act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | LayerCache, image: torch.Tensor | None,
                image_mask: torch.Tensor | None, gate: torch.Tensor) -> torch.Tensor:
        cache = mask if isinstance(mask, LayerCache) else None
        return self.image(self.text(x, mask), image, image_mask, gate, cache)


class CaptionDecoder(nn.Module):
    """The multimodal text decoder: ``depth`` decoder layers over the text tower's tokens (pre-norm
    :class:`DecoderBlock` and a norm, OpenCLIP's :class:`SplitDecoderBlock` and a norm, or BERT's
    post-norm layers), and the map to the vocabulary (its own, or the token embedding when ``tied``;
    with BERT's transform first, ``head`` transform)."""

    def __init__(self, cfg: DecoderConfig, width: int, image_width: int, vocab_size: int,
                 embedding: nn.Embedding | None = None):
        super().__init__()
        if cfg.head not in HEADS:
            raise ValueError(f"decoder head must be one of {HEADS}, got {cfg.head!r}")
        self.cfg = cfg
        self.width = width
        self.image_width = image_width
        self.blocks = nn.ModuleList(self._layer(image_width) for _ in range(cfg.depth))
        self.norm = None if cfg.post_norm else LayerNorm(width)
        if cfg.tied and (embedding is None or embedding.embedding_dim != width):
            raise ValueError("a tied decoder needs the text tower's token embedding, of the decoder's width")
        self.embedding = [embedding] if cfg.tied else None  # a list: the tied weight is registered in the text tower
        self.head = None
        if cfg.head == "transform":
            self.head = MLMHead(width, embedding if cfg.tied else None, vocab_size, cfg.act, cfg.norm_eps)
        elif not cfg.tied:
            self.head = nn.Linear(width, vocab_size, bias=False)
            nn.init.normal_(self.head.weight, std=width**-0.5)
        self.checkpointing = False

    def _layer(self, image_width: int) -> nn.Module:
        c = self.cfg
        if c.post_norm:
            return PostNormBlock(self.width, c.heads, c.mlp_ratio, c.act, c.norm_eps, image_width)
        layer = SplitDecoderBlock if c.separate_cross else DecoderBlock
        return layer(self.width, c.heads, image_width, c.mlp_ratio, c.act)

    def readout(self, x: torch.Tensor) -> torch.Tensor:
        """The states the map to the vocabulary reads, of the last layer's ``x``: after the final
        norm, and BERT's transform (``head`` transform)."""
        if self.norm is not None:
            x = self.norm(x)
        return self.head.transform(x) if isinstance(self.head, MLMHead) else x

    @property
    def vocabulary(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The map to the vocabulary: its weight [V, W] (the token embedding, when tied) and its
        per-token bias [V] (the transform head's; None without one)."""
        if isinstance(self.head, MLMHead):
            return self.head.weight, self.head.bias
        return (self.head.weight if self.head is not None else self.embedding[0].weight), None

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.readout(x), *self.vocabulary)

    def states(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
               has_image: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, L, W] what the map to the vocabulary reads (:meth:`readout`) of captions [B, L, W]
        (the causal text tower's tokens) reading ``image_tokens``' real tokens [B, M, Wv], except in
        the rows where ``has_image`` is false. ``mask`` [B, 1, L, L] (bool, True: may attend)
        replaces the causal one made from ``attention_mask``."""
        if mask is None:
            mask = key_padding_mask(attention_mask, causal=True)
        gate = has_image.to(text_tokens.dtype)[:, None, None]
        x = run_blocks(self.blocks, text_tokens, mask, image_tokens.values, image_tokens.cross_mask, gate,
                       checkpointing=self.checkpointing)
        return self.readout(x)

    def forward(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
                has_image: torch.Tensor) -> torch.Tensor:
        """[B, L, V] next-token logits of :meth:`states`."""
        return F.linear(self.states(text_tokens, attention_mask, image_tokens, has_image), *self.vocabulary)

    def step(self, text_tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """[B, n, V] logits of the new positions' text tokens [B, n, W], given ``cache`` (which grows)."""
        x, gate = text_tokens, cache.gate.to(text_tokens.dtype)
        for blk, layer in zip(self.blocks, cache.layers):
            x = blk(x, layer, cache.image, cache.image_mask, gate)
        cache.image = None  # its keys and values are cached now
        return self.logits(x)

    def flops(self, length: int, image_tokens: int, vocab_size: int) -> float:
        c = self.cfg
        blocks = c.depth * block_flops(length, self.width, c.mlp_ratio, image_tokens, self.image_width)
        if c.separate_cross:  # the second feed-forward
            blocks += c.depth * 4.0 * length * self.width * mlp_width(self.width, c.mlp_ratio)
        if c.head == "transform":
            blocks += 2.0 * length * self.width * self.width
        return blocks + 2.0 * length * self.width * vocab_size
