"""Fusion encoder (ALBEF style): text tokens attend to themselves and, through cross-attention, to
the image tokens; its first output token feeds the image-text matching head, every token the MLM head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vltrain.model.blocks import CrossBlock, LayerNorm, block_flops, key_padding_mask, run_blocks


@dataclass
class FusionConfig:
    depth: int = 6
    heads: int = 12
    mlp_ratio: float = 4.0


class FusionEncoder(nn.Module):
    def __init__(self, cfg: FusionConfig, width: int, image_width: int):
        super().__init__()
        self.cfg = cfg
        self.width = width
        self.image_width = image_width
        self.blocks = nn.ModuleList(CrossBlock(width, cfg.heads, image_width, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.norm = LayerNorm(width)
        self.checkpointing = False

    def forward(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``image_mask`` [B, M] (bool): the image tokens that are real, for images at their own shape
        padded to a common length (None: all)."""
        mask = key_padding_mask(attention_mask)
        cross = None if image_mask is None else image_mask[:, None, None, :]
        x = run_blocks(self.blocks, text_tokens, mask, image_tokens, cross, checkpointing=self.checkpointing)
        return self.norm(x)

    def flops(self, length: int, image_tokens: int) -> float:
        c = self.cfg
        return c.depth * block_flops(length, self.width, c.mlp_ratio, image_tokens, self.image_width)
