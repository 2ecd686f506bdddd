"""Vision tower: a pre-norm ViT with the layout of OpenCLIP's, so its sizes compare like with like."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.model.blocks import Block, block_flops, run_blocks


@dataclass
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    pooling: str = "cls"
    """cls (the class token) | mean (of the patch tokens)."""

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionTransformer(nn.Module):
    """Patches -> [class token, patch tokens] + positions -> norm -> blocks -> norm.

    Returns every token (for the fusion encoder's cross-attention) and the pooled vector (for the
    contrastive embedding).
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image size {cfg.image_size} is not a multiple of patch size {cfg.patch_size}")
        if cfg.pooling not in ("cls", "mean"):
            raise ValueError(f"vision pooling must be cls or mean, got {cfg.pooling!r}")
        self.cfg = cfg
        self.width = cfg.width
        self.patch_embed = nn.Conv2d(3, cfg.width, cfg.patch_size, stride=cfg.patch_size, bias=False)
        self.cls_token = nn.Parameter(torch.randn(cfg.width) * cfg.width**-0.5)
        self.pos_embed = nn.Parameter(torch.randn(cfg.num_patches + 1, cfg.width) * cfg.width**-0.5)
        self.norm_pre = nn.LayerNorm(cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.width)
        self.checkpointing = False

    def forward(
        self, pixels: torch.Tensor, patch_mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``patch_mask`` [B, patches] (bool): those patches enter as ``mask_token`` (masked image modelling)."""
        x = self.embed_patches(pixels)
        if patch_mask is not None:
            x = torch.where(patch_mask[..., None], mask_token.to(x.dtype), x)
        cls = self.cls_token.to(x.dtype).expand(x.shape[0], 1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed.to(x.dtype)
        x = run_blocks(self.blocks, self.norm_pre(x), checkpointing=self.checkpointing)
        x = self.norm(x)
        pooled = x[:, 0] if self.cfg.pooling == "cls" else x[:, 1:].mean(dim=1)
        return x, pooled

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, patches, width]: the stride-p convolution written as one matmul over
        non-overlapping p x p patches: the same weights, without the convolution's slow CPU backward
        (``docs/benchmarks.md#trainer-step-throughput-fp32-vs-bf16-autocast-mfu``)."""
        b, c, h, w = pixels.shape
        p = self.cfg.patch_size
        patches = pixels.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5).reshape(b, -1, c * p * p)
        return F.linear(patches, self.patch_embed.weight.flatten(1))

    @property
    def num_tokens(self) -> int:
        return self.cfg.num_patches + 1

    def flops(self) -> float:
        """Forward matmul FLOPs for one image."""
        c = self.cfg
        patch = 2 * c.num_patches * 3 * c.patch_size**2 * c.width
        return patch + c.depth * block_flops(self.num_tokens, c.width, c.mlp_ratio)
