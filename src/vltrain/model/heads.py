"""Heads on top of the towers: projections to the shared embedding space, ITM and MLM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.model.blocks import ACTIVATIONS

PROJECTIONS = ("linear", "linear_bias", "none")


class Projection(nn.Module):
    """Linear map to the shared embedding size, then L2 normalization (cosine similarities).

    ``kind``: linear (no bias: CLIP), linear_bias (SigLIP's text head) or none (the pooled vector
    itself: SigLIP's image side, whose attention-pool head ends at the embedding size)."""

    def __init__(self, width: int, embed_dim: int, kind: str = "linear"):
        super().__init__()
        if kind not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {kind!r}")
        if kind == "none" and width != embed_dim:
            raise ValueError(f"projection none needs the tower width {width} to equal the embedding size {embed_dim}")
        self.kind = kind
        self.embed_dim = embed_dim
        self.proj = None
        if kind != "none":
            self.proj = nn.Linear(width, embed_dim, bias=kind == "linear_bias")
            nn.init.normal_(self.proj.weight, std=width**-0.5)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        return F.normalize(pooled if self.proj is None else self.proj(pooled), dim=-1)


class ITMHead(nn.Module):
    """Matched / not matched, from the fused first token."""

    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 2)

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return self.fc(fused[:, 0])


class MIMHead(nn.Module):
    """SimMIM's parts: a learned token that stands in for masked patches, and a linear decoder from
    each patch token to its patch's pixels (3 x p x p values)."""

    def __init__(self, width: int, patch_size: int):
        super().__init__()
        self.mask_token = nn.Parameter(torch.randn(width) * 0.02)
        self.decoder = nn.Linear(width, 3 * patch_size * patch_size)

    def forward(self, patch_tokens: torch.Tensor) -> torch.Tensor:
        return self.decoder(patch_tokens)


class MLMHead(nn.Module):
    """BERT's LM head: a transform (dense, activation, norm), then the map to the vocabulary plus a
    per-token bias. The map's weight is the text token embedding (tied), or its own when no
    ``embedding`` is given (``vocab_size`` rows)."""

    def __init__(self, width: int, embedding: nn.Embedding | None, vocab_size: int = 0, act: str = "gelu",
                 eps: float = 1e-5):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = ACTIVATIONS[act]
        self.norm = nn.LayerNorm(width, eps=eps)
        self.embedding = None if embedding is None else [embedding]  # a list: the tied weight is registered once
        vocab_size = vocab_size if embedding is None else embedding.num_embeddings
        self.decoder = nn.Linear(width, vocab_size, bias=False) if embedding is None else None
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def transform(self, fused: torch.Tensor) -> torch.Tensor:
        """The states the map to the vocabulary reads: dense, activation, norm."""
        return self.norm(self.act(self.dense(fused)))

    @property
    def weight(self) -> torch.Tensor:
        """[V, W] the map to the vocabulary (the token embedding, when tied)."""
        return self.decoder.weight if self.embedding is None else self.embedding[0].weight

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(fused), self.weight, self.bias)
