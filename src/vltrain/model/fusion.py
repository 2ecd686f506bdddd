"""Fusion encoder (ALBEF style): text tokens attend to themselves and, through cross-attention, to
the image tokens; its first output token feeds the image-text matching head, every token the MLM head.

With ``shared`` (BLIP's text encoder) the fusion encoder has no layers of its own: the fusion pass is
the text tower's own layers run again, their cross-attention reading the image, from the text
tower's embedded tokens (what the tower hands on for it: :meth:`TextTransformer.fuse`). One set of
weights encodes text alone (ITC) and fused with an image (ITM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vltrain.model.blocks import CrossBlock, LayerNorm, block_flops, key_padding_mask, run_blocks
from vltrain.types import Tokens


@dataclass
class FusionConfig:
    depth: int = 6
    heads: int = 12
    mlp_ratio: float = 4.0
    shared: bool = False
    """The fusion pass is the text tower's own layers with their cross-attention (BLIP): no layers
    of its own (``depth``, ``heads`` and ``mlp_ratio`` are the tower's); needs a post-norm text tower."""


class FusionEncoder(nn.Module):
    def __init__(self, cfg: FusionConfig, width: int, image_width: int, text: nn.Module | None = None):
        """``text``: the text tower whose layers a ``shared`` fusion runs (kept in a list, so that its
        parameters stay registered once, in the tower)."""
        super().__init__()
        if cfg.shared and not hasattr(text, "fuse"):
            raise ValueError("a shared fusion encoder needs a text tower whose layers cross-attend (post_norm)")
        self.cfg = cfg
        self.width = width
        self.image_width = image_width
        self.text = [text] if cfg.shared else None
        depth = 0 if cfg.shared else cfg.depth
        self.blocks = nn.ModuleList(CrossBlock(width, cfg.heads, image_width, cfg.mlp_ratio) for _ in range(depth))
        self.norm = None if cfg.shared else LayerNorm(width)
        self.checkpointing = False

    def forward(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        """Captions attending to ``image_tokens``' real tokens (all of a square image's)."""
        mask = key_padding_mask(attention_mask)
        image, cross = image_tokens.values, image_tokens.cross_mask
        if self.text is not None:
            return self.text[0].fuse(text_tokens, mask, image, cross)
        x = run_blocks(self.blocks, text_tokens, mask, image, cross, checkpointing=self.checkpointing)
        return self.norm(x)

    def flops(self, length: int, image_tokens: int) -> float:
        c = self.cfg
        return c.depth * block_flops(length, self.width, c.mlp_ratio, image_tokens, self.image_width)
