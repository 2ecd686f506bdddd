"""Pre-norm transformer pieces shared by the towers and the fusion encoder.

Attention goes through ``attention``: ``F.scaled_dot_product_attention`` (flash / memory-efficient
kernels on GPUs, the fused flash kernel for fp32 on CPU), except for bf16/fp16 on a CPU that
multiplies bf16 in hardware (AVX-512 BF16, AMX), where two plain matmuls and a softmax beat both CPU
kernels (figures: ``docs/benchmarks/cpu-training.md#cpu-attention-in-bf16``). Without those instructions a bf16
batched matmul is emulated and the flash kernel wins over a whole step
(``docs/benchmarks/cpu-training.md#one-step-against-transformers``).
Nothing here casts dtypes: under bf16 autocast the matmuls run in bf16 and the layer norms in fp32,
as autocast decides.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vltrain.runtime.precision import cpu_has_bf16_matmul


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the activation OpenAI's CLIP weights were trained with."""
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {"gelu": F.gelu, "gelu_tanh": _gelu_tanh, "quick_gelu": quick_gelu}
"""The MLP activations a tower may use: exact GELU (our presets, OpenCLIP), its tanh approximation
(SigLIP) and QuickGELU (OpenAI's CLIP)."""


class LayerNorm(nn.LayerNorm):
    """LayerNorm that computes in fp32 and returns its input's dtype.

    Under CUDA autocast ``layer_norm`` runs in fp32 and returns fp32: the residual stream then
    turns fp32 and every Linear after it casts its input back to bf16, extra passes over memory
    in every block. Here only the statistics are fp32; a bf16 stream stays bf16. Outside
    autocast an fp32 input takes ``nn.LayerNorm``'s own path, so fp32 results are unchanged, and so
    does a float64 one (computed in fp32, its result would carry fp32's rounding).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if x.dtype in (torch.float32, torch.float64) and not torch.is_autocast_enabled(device):
            return super().forward(x)
        weight = None if self.weight is None else self.weight.float()
        bias = None if self.bias is None else self.bias.float()
        with torch.autocast(device, enabled=False):
            return F.layer_norm(x.float(), self.normalized_shape, weight, bias, self.eps).to(x.dtype)


def in_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the autocast dtype when autocast is on (a tower's residual stream starts there), else ``x``."""
    device = x.device.type
    return x.to(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else x


@functools.cache
def cpu_multiplies_bf16() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX-512 BF16 or AMX): asked once."""
    return cpu_has_bf16_matmul()


class CausalPrefix:
    """The mask of causal, right-padded text, left to the kernel as ``is_causal``.

    An explicit [B, 1, L, L] mask rules out the flash and cuDNN kernels on a GPU. With right
    padding every key before a real query is real, so a real position attends to the same keys
    either way; only padded positions differ, and no real position, pooling or loss reads them.
    Used on CUDA only (:func:`text_mask`): CPU results stay those of the explicit mask.
    """


CAUSAL_PREFIX = CausalPrefix()


def text_mask(attention_mask: torch.Tensor, causal: bool) -> torch.Tensor | CausalPrefix:
    """The self-attention mask of a right-padded text batch (see :class:`CausalPrefix`)."""
    if causal and attention_mask.device.type == "cuda":
        return CAUSAL_PREFIX
    return key_padding_mask(attention_mask, causal)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | CausalPrefix | None = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) masked) v over [B, heads, L, d]; ``mask`` is boolean, True = may attend."""
    if isinstance(mask, CausalPrefix):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if q.device.type != "cpu" or q.dtype == torch.float32 or not cpu_multiplies_bf16():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # CPU, low precision: PyTorch's CPU flash kernel has a slow bf16 backward and its math fallback
    # makes fp32 copies of the scores; in the input dtype, with an additive mask, the few passes over
    # the (small) score matrices of CPU-sized models are cheap
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores + torch.zeros((), dtype=scores.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(dim=-1), v)


@dataclass
class Packed:
    """A padded batch's kept tokens as rows of one matrix: ``index`` into the flattened
    [batch x length] positions, and the attention mask of the padded layout."""

    index: torch.Tensor
    batch: int
    length: int
    mask: torch.Tensor | None
    real: int
    """How many of ``index``'s first positions are text; those after them are padding positions
    that round the row count up (``packed_tokens``' ``multiple``)."""

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, W] -> [batch, length, W], zero where no token was kept. ``x`` may hold only the
        first rows (the text ones): the rest of the layout is zero then."""
        out = x.new_zeros(self.batch * self.length, x.shape[-1])
        return out.index_copy(0, self.index[: x.shape[0]], x).view(self.batch, self.length, x.shape[-1])


@dataclass
class LayerCache:
    """One block's cached keys and values, [B, heads, positions, head width] each."""

    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    image_k: torch.Tensor | None = None
    image_v: torch.Tensor | None = None

    def select(self, index: torch.Tensor) -> "LayerCache":
        return LayerCache(*(None if t is None else t.index_select(0, index)
                            for t in (self.k, self.v, self.image_k, self.image_v)))


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, L, W] -> [B, heads, L, W / heads]."""
    b, n, w = x.shape
    return x.view(b, n, heads, w // heads).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, d] -> [B, L, heads * d]."""
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


def cached_self_attention(attn: "SelfAttention", x: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    """``attn`` over the new positions ``x`` [B, n, W], attending to the cached positions and,
    causally, to each other; the cache grows by the new keys and values."""
    q, k, v = (split_heads(t, attn.heads) for t in attn.qkv(x).chunk(3, dim=-1))
    if cache.k is not None:
        k, v = torch.cat([cache.k, k], dim=2), torch.cat([cache.v, v], dim=2)
    cache.k, cache.v = k, v
    n, total = q.shape[2], k.shape[2]
    mask = None
    if n > 1:  # a prompt: causal among its own positions
        mask = torch.ones(n, total, dtype=torch.bool, device=x.device).tril(total - n)
    return attn.out(merge_heads(attention(q, k, v, mask)))


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by {heads} heads")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, mask: "torch.Tensor | Packed | LayerCache | None" = None) -> torch.Tensor:
        """``mask``: boolean, True = may attend; :class:`Packed` tokens; or a :class:`LayerCache`
        (generation: ``x`` holds the new positions, attending to the cached ones and causally to
        each other, and the cache grows by them)."""
        if isinstance(mask, LayerCache):
            return cached_self_attention(self, x, mask)
        if isinstance(mask, Packed):  # projections over the packed tokens, attention in the padded layout
            qkv = mask.unpack(self.qkv(x))
            b, n, w = qkv.shape[0], qkv.shape[1], x.shape[-1]
            q, k, v = qkv.view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
            y = attention(q, k, v, mask.mask).transpose(1, 2).reshape(b * n, w)
            return self.out(y[mask.index])
        b, n, w = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        y = attention(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(b, n, w))


class CrossAttention(nn.Module):
    """Queries from one sequence (text), keys and values from another (image tokens)."""

    def __init__(self, width: int, heads: int, kv_width: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(kv_width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None, mask: torch.Tensor | None = None,
                cache: LayerCache | None = None) -> torch.Tensor:
        """``mask`` [B, 1, 1, M] (bool): the context tokens each row may attend to (None: all).
        ``cache`` (generation): the context's keys and values, computed from ``context`` on the
        first call and read from the cache after it."""
        b, n, w = x.shape
        h, d = self.heads, w // self.heads
        q = self.q(x).view(b, n, h, d).transpose(1, 2)
        if cache is not None and cache.image_k is not None:
            k, v = cache.image_k, cache.image_v
        else:
            k, v = self.kv(context).view(b, context.shape[1], 2, h, d).permute(2, 0, 3, 1, 4)
            if cache is not None:
                cache.image_k, cache.image_v = k, v
        y = attention(q, k, v, mask)
        return self.out(y.transpose(1, 2).reshape(b, n, w))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int, act: str = "gelu"):
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}, got {act!r}")
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)
        self.act = ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


def mlp_width(width: int, mlp_ratio: float) -> int:
    """The MLP's hidden width; rounded, so a ratio read from a checkpoint (4304 / 1152) gives its width back."""
    return round(width * mlp_ratio)


class Block(nn.Module):
    """x + attn(norm(x)), then x + mlp(norm(x)).

    ``x`` is [B, L, W] with an attention mask, or the kept tokens [T, W] of a padded batch with
    their :class:`Packed` layout: everything but attention is token-wise; or new positions with a
    :class:`LayerCache` of the earlier ones (generation). The cache goes through ``forward``, so
    FSDP2 gathers the block's parameters for generation as for training.
    """

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0, act: str = "gelu", eps: float = 1e-5):
        super().__init__()
        self.norm1 = LayerNorm(width, eps=eps)
        self.attn = SelfAttention(width, heads)
        self.norm2 = LayerNorm(width, eps=eps)
        self.mlp = MLP(width, mlp_width(width, mlp_ratio), act)

    def forward(self, x: torch.Tensor, mask: "torch.Tensor | Packed | LayerCache | None" = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class CrossBlock(nn.Module):
    """Self-attention over text, cross-attention from text to image tokens, feed-forward; all pre-norm
    residuals (the hierarchical fusion block: image features enter text features through attention,
    a residual and a layer norm)."""

    def __init__(self, width: int, heads: int, image_width: int, mlp_ratio: float = 4.0, act: str = "gelu"):
        super().__init__()
        self.norm1 = LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.norm2 = LayerNorm(width)
        self.cross = CrossAttention(width, heads, image_width)
        self.norm3 = LayerNorm(width)
        self.mlp = MLP(width, mlp_width(width, mlp_ratio), act)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, image: torch.Tensor,
                image_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask)
        x = x + self.cross(self.norm2(x), image, image_mask)
        return x + self.mlp(self.norm3(x))


class PostNormBlock(nn.Module):
    """BERT's layer: each sublayer's residual, then its norm (``x = norm(x + f(x))``), where the
    blocks above are pre-norm. Self-attention, then, when the block has one (``image_width`` > 0),
    cross-attention to image tokens, then the feed-forward: BLIP's text encoder and decoder.

    Called as :class:`Block` is (``x`` and a mask, :class:`Packed` tokens or a :class:`LayerCache`),
    the cross-attention is skipped: BLIP's text encoder encodes text alone so, with the same
    weights that fuse it with an image. Given ``image`` (or a cache that holds its keys and
    values), it reads it, scaled per row by ``gate`` [B, 1, 1] when given (a text-only row reads
    no image, as :class:`vltrain.model.decoder.DecoderBlock` does); its norm applies either way.
    """

    def __init__(self, width: int, heads: int, mlp_ratio: float = 4.0, act: str = "gelu", eps: float = 1e-12,
                 image_width: int = 0):
        super().__init__()
        self.attn = SelfAttention(width, heads)
        self.attn_norm = LayerNorm(width, eps=eps)
        self.cross = CrossAttention(width, heads, image_width) if image_width else None
        self.cross_norm = LayerNorm(width, eps=eps) if image_width else None
        self.mlp = MLP(width, mlp_width(width, mlp_ratio), act)
        self.mlp_norm = LayerNorm(width, eps=eps)

    def forward(self, x: torch.Tensor, mask: "torch.Tensor | Packed | LayerCache | None" = None,
                image: torch.Tensor | None = None, image_mask: torch.Tensor | None = None,
                gate: torch.Tensor | None = None) -> torch.Tensor:
        cache = mask if isinstance(mask, LayerCache) else None
        x = self.attn_norm(x + self.attn(x, mask))
        if image is not None or (cache is not None and cache.image_k is not None):
            y = self.cross(x, image, image_mask, cache)
            x = self.cross_norm(x + (y if gate is None else gate * y))
        return self.mlp_norm(x + self.mlp(x))


def run_blocks(blocks: nn.ModuleList, x: torch.Tensor, *args, checkpointing: bool = False) -> torch.Tensor:
    """Apply blocks in order; with ``checkpointing`` each block's activations are recomputed in backward."""
    for blk in blocks:
        if checkpointing and torch.is_grad_enabled():
            x = checkpoint(blk, x, *args, use_reentrant=False)
        else:
            x = blk(x, *args)
    return x


def key_padding_mask(attention_mask: torch.Tensor, causal: bool = False) -> torch.Tensor:
    """Boolean SDPA mask [B, 1, L, L] (True = may attend) from a [B, L] padding mask.

    The first key is always attendable, so a row with no text (all padding) yields finite zeros-in,
    finite-out attention instead of NaN; such rows are masked out of every loss anyway.
    """
    keys = attention_mask.bool().clone()
    keys[:, 0] = True
    mask = keys[:, None, None, :]
    if causal:
        n = attention_mask.shape[1]
        mask = mask & torch.ones(n, n, dtype=torch.bool, device=keys.device).tril()
    return mask


def block_flops(tokens: int, width: int, mlp_ratio: float = 4.0, context: int = 0, context_width: int = 0) -> float:
    """Forward matmul FLOPs of one (cross) block over ``tokens`` queries (2 FLOPs per multiply-add)."""
    hidden = mlp_width(width, mlp_ratio)
    f = 2 * tokens * (4 * width * width + 2 * width * hidden)  # qkv, out, mlp
    f += 2 * 2 * tokens * tokens * width  # scores and weighted sum
    if context:
        f += 2 * (tokens * 2 * width * width + context * context_width * 2 * width)  # q, out, kv
        f += 2 * 2 * tokens * context * width
    return float(f)
