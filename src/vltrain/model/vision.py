"""Vision tower: a pre-norm ViT with the layout of OpenCLIP's, so its sizes compare like with like.

The fields after ``pooling`` describe imported architectures (``model.init``): SigLIP's ViT has no
class token, no norm before the blocks, a bias on the patch embedding and an attention-pool head.
Their defaults build exactly the modules (and parameter names) of the presets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.model.blocks import MLP, Block, LayerNorm, attention, block_flops, mlp_width, run_blocks
from vltrain.images import Images
from vltrain.pixels import drop_packed, packed_places, patchify, unpack
from vltrain.types import Tokens
from vltrain.runtime.precision import at_least_fp32

VISION_POOLINGS = ("cls", "mean", "map", "attn_pool")


@dataclass
class VisionConfig:
    image_size: int = 224
    patch_size: int = 16
    width: int = 768
    depth: int = 12
    heads: int = 12
    mlp_ratio: float = 4.0
    pooling: str = "cls"
    """cls (the class token) | mean (of the patch tokens) | map (a learned probe attends over the
    tokens, then a residual MLP: SigLIP's multihead attention pooling head) | attn_pool (OpenCLIP's
    CoCa: ``pool_queries`` learned queries attend over the blocks' tokens, then the norm; the first
    query is the pooled vector, the others are the tokens the decoder and fusion read:
    :class:`AttentionalPooler`)."""
    act: str = "gelu"
    """MLP activation: gelu | gelu_tanh | quick_gelu (``vltrain.model.blocks.ACTIVATIONS``)."""
    norm_eps: float = 1e-5
    class_token: bool = True
    pre_norm: bool = True
    """A layer norm after the position embedding, before the blocks (CLIP's ln_pre)."""
    patch_bias: bool = False
    pool_queries: int = 256
    """attn_pool: the number of queries (the first pooled, the rest the tower's tokens)."""
    pool_heads: int = 8
    pool_width: int = 0
    """attn_pool: the queries' width, that of the tower's output (OpenCLIP: the embedding's); 0: ``width``."""

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class VisionTransformer(nn.Module):
    """Patches -> [class token, patch tokens] + positions -> norm -> blocks -> norm.

    Returns every token with the mask of the real ones (:class:`vltrain.types.Tokens`, for the fusion
    encoder's cross-attention) and the pooled vector (for the contrastive embedding). The mask is
    made here, where the layout is known, and nowhere else.
    """

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        if cfg.image_size % cfg.patch_size:
            raise ValueError(f"image size {cfg.image_size} is not a multiple of patch size {cfg.patch_size}")
        if cfg.pooling not in VISION_POOLINGS or (cfg.pooling == "cls" and not cfg.class_token):
            raise ValueError(f"vision pooling must be one of {VISION_POOLINGS} (cls needs the class token), "
                             f"got {cfg.pooling!r}")
        self.cfg = cfg
        pooler = cfg.pooling == "attn_pool"
        # the width of the tokens and the pooled vector the tower returns
        self.width = (cfg.pool_width or cfg.width) if pooler else cfg.width
        self.num_prefix = int(cfg.class_token)
        self.patch_embed = nn.Conv2d(3, cfg.width, cfg.patch_size, stride=cfg.patch_size, bias=cfg.patch_bias)
        self.cls_token = nn.Parameter(torch.randn(cfg.width) * cfg.width**-0.5) if cfg.class_token else None
        self.pos_embed = nn.Parameter(torch.randn(cfg.num_patches + self.num_prefix, cfg.width) * cfg.width**-0.5)
        self.norm_pre = LayerNorm(cfg.width, eps=cfg.norm_eps) if cfg.pre_norm else None
        self.blocks = nn.ModuleList(
            Block(cfg.width, cfg.heads, cfg.mlp_ratio, cfg.act, cfg.norm_eps) for _ in range(cfg.depth)
        )
        self.pooler = AttentionalPooler(cfg, self.width) if pooler else None
        self.norm = LayerNorm(self.width, eps=cfg.norm_eps)
        self.head = AttentionPool(cfg) if cfg.pooling == "map" else None
        self.patch_dropout = PatchDropout(self.num_prefix)
        self.checkpointing = False

    def forward(self, images: Images | torch.Tensor, patch_mask: torch.Tensor | None = None,
                mask_token: torch.Tensor | None = None) -> tuple[Tokens, torch.Tensor]:
        """One forward for every layout: embed (:meth:`embed`, the only step that depends on it),
        then the pre-norm, the blocks and the norm, attending within each image, then one pooling
        over each image's tokens.

        ``images``: an :class:`~vltrain.images.Images` (a tensor: square images). Whatever the layout
        in, the tokens come out one image per row, as the padded layout has them (packed ones
        unpacked, :meth:`unpack`): the fusion encoder, the pooling and evaluation read one layout.
        ``patch_mask`` [B, patches] (bool): those patches enter as ``mask_token`` (masked image
        modelling; not packed). Under patch dropout (``images.keep``) the tokens come out K (and the
        class token) per row, whatever the layout (:class:`PatchDropout`)."""
        if isinstance(images, torch.Tensor):
            images = Images(images)
        x, real, attend, lay_out = self.embed(images, patch_mask, mask_token)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        x = run_blocks(self.blocks, x, attend, checkpointing=self.checkpointing)
        if self.pooler is None:
            x = self.norm(x)
        x, real = lay_out(x, real)
        if self.pooler is not None:
            x = self.norm(self.pooler(x, real))
            return Tokens(x[:, 1:], None), x[:, 0]
        return Tokens(x, real), self.pool(x, real)

    def embed(self, images: Images, patch_mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None):
        """The tower's one reader of the layout: ``images``' tokens with their positions, those patch
        dropout keeps, which are real (None: all), what attention takes, and what lays the blocks'
        output out one image per row: (tokens, real, attend, lay_out).

        Square images (the fast path) make and read no mask. Images at their own shape, one to a row,
        are :meth:`embed_grids`; packed ones :meth:`embed_packed`, whose sequences keep only the kept
        patches and are unpacked after the blocks."""
        keep = images.keep
        if images.layout == "packed":
            return self.embed_packed(images)
        if images.layout == "padded":
            x, real = self.embed_grids(images.pixels, images.grids, patch_mask, mask_token)
            x, real = self.patch_dropout(x, keep), self.patch_dropout(real, keep)
            return x, real, real[:, None, None, :], _as_is
        return self.embed_square(images.pixels, patch_mask, mask_token, keep), None, None, _as_is

    def embed_square(self, pixels: torch.Tensor, patch_mask: torch.Tensor | None = None,
                     mask_token: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 1 + patches, W] (no class token: [B, patches, W]): square images' tokens with positions;
        with ``keep`` [B, K], only the kept patches: [B, 1 + K, W]."""
        x = self.embed_patches(pixels)
        if patch_mask is not None:
            x = torch.where(patch_mask[..., None], mask_token.to(x.dtype), x)
        pos = self.pos_embed.to(x.dtype)
        x = x + pos[self.num_prefix:]
        x = self.patch_dropout(x, keep, prefix=0)
        if self.cls_token is not None:
            cls = (self.cls_token.to(x.dtype) + pos[0]).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
        return x

    def embed_grids(self, patches: torch.Tensor, grids: torch.Tensor, patch_mask: torch.Tensor | None = None,
                    mask_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Images at their own shape: ``patches`` [B, N, 3 * p * p], image i's first rows x cols of
        them real (``grids[i]``), row by row, the rest padding. Returns their tokens and which are
        real (the class token and each image's patches).

        Each image's positions are the table resized to its grid (:func:`resize_positions`), and
        every token attends only to its own image's real patches (and class token): what an image
        becomes does not depend on its padding or its batch. Padded positions come out as tokens
        no pooling reads."""
        x = self.project_patches(patches)
        if patch_mask is not None:
            x = torch.where(patch_mask[..., None], mask_token.to(x.dtype), x)
        n = x.shape[1]
        real = Images(patches, grids).real
        table = self.pos_embed[self.num_prefix:]
        x = x + resize_positions(table, self.cfg.image_size // self.cfg.patch_size, grids, n).to(x.dtype)
        if self.cls_token is not None:
            cls = (self.cls_token + self.pos_embed[0]).to(x.dtype).expand(x.shape[0], 1, -1)
            x = torch.cat([cls, x], dim=1)
            real = torch.cat([real.new_ones(x.shape[0], 1), real], dim=1)
        return x, real

    def embed_packed(self, images: Images):
        """Images packed several to a sequence (:meth:`embed`'s four results): ``pixels`` [S, N, 3 * p * p],
        ``segments`` [S, N] the row (of ``grids`` [B, 2]) whose image each position holds (-1:
        padding), ``patch_index`` which of its patches; under patch dropout only the kept patches,
        in sequences shortened to them (:meth:`PatchDropout.sequences`). With a class token,
        ``slots`` [S, K] (the rows each sequence holds) gives the K positions put before each
        sequence's patches, one class token per image. Attention stays inside each image, so each
        image's tokens are the ones it gets alone."""
        width = images.positions(self.cfg.patch_size)  # the padded layout's positions per image
        patches, segments, patch_index = self.patch_dropout.sequences(images)
        x = self.project_patches(patches)
        positions = resize_positions(self.pos_embed[self.num_prefix:], self.cfg.image_size // self.cfg.patch_size,
                                     images.grids, width)
        x = x + positions[segments.clamp(min=0), patch_index].to(x.dtype)
        owners, slots = segments, 0  # the row of each position
        if self.cls_token is not None:
            cls = (self.cls_token + self.pos_embed[0]).to(x.dtype).expand(*images.slots.shape, -1)
            x, owners, slots = torch.cat([cls, x], dim=1), torch.cat([images.slots, segments], dim=1), images.slots.shape[1]
        attend = (owners[:, :, None] == owners[:, None, :])[:, None]  # padding attends to padding

        def lay_out(x: torch.Tensor, real: None) -> tuple[torch.Tensor, torch.Tensor]:
            x, real = self.unpack(x, images, segments, patch_index, slots)
            return self.patch_dropout(x, images.keep), self.patch_dropout(real, images.keep)

        return x, None, attend, lay_out

    def unpack(self, x: torch.Tensor, images: Images, segments: torch.Tensor, patch_index: torch.Tensor,
               slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens of packed sequences [S, K + N', W] (``slots`` K class-token positions, then
        patches placed by ``segments`` and ``patch_index``, :meth:`embed_packed`) laid out one image
        per row, as :meth:`embed_grids` lays them: [B, prefix + N, W], its class token first, then its
        patches, then tokens no reader reads; and which are real. A row without an image (its grid
        1 x 1) reads some other position, finite and unread."""
        rows, length = len(images), images.positions(self.cfg.patch_size)
        tokens = unpack(x[:, slots:], packed_places(segments, patch_index, rows, length))
        real = images.real
        if not slots:
            return tokens, real
        # each row's class token: where its slot is (a row without an image reads slot 0, unread)
        place = torch.arange(images.slots.numel(), device=x.device)
        at = images.slots.new_zeros(rows + 1).scatter_(0, (images.slots + 1).flatten(), place)[1:]
        tokens = torch.cat([x[:, :slots].flatten(0, 1)[at][:, None], tokens], dim=1)
        return tokens, torch.cat([real.new_ones(rows, 1), real], dim=1)

    def pool(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """The image's vector; ``real`` [B, tokens] (bool): the tokens pooling may read (None: all)."""
        if self.cfg.pooling == "cls":
            return x[:, 0]
        if self.cfg.pooling == "mean":
            if real is None:
                return x[:, self.num_prefix:].mean(dim=1)
            keep = real[:, self.num_prefix:, None].to(x.dtype)
            return (x[:, self.num_prefix:] * keep).sum(dim=1) / keep.sum(dim=1)
        return self.head(x, real)

    def embed_patches(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] -> [B, patches, width]: the stride-p convolution written as one matmul over
        non-overlapping p x p patches: the same weights, without the convolution's slow CPU backward
        (``docs/benchmarks/cpu-training.md#trainer-step-throughput-fp32-vs-bf16-autocast-mfu``)."""
        return self.project_patches(patchify(pixels, self.cfg.patch_size))

    def project_patches(self, patches: torch.Tensor) -> torch.Tensor:
        """[..., 3 * p * p] flattened patches -> [..., width]. Pixels arrive in fp32; an fp64 tower
        (``train.precision: fp64``) takes them in its own dtype."""
        weight = self.patch_embed.weight
        return F.linear(patches.to(weight.dtype), weight.flatten(1), self.patch_embed.bias)

    @property
    def num_tokens(self) -> int:
        return self.cfg.num_patches + self.num_prefix

    def flops(self, kept: int | None = None) -> float:
        """Forward matmul FLOPs for one image whose blocks see ``kept`` of its patches (patch
        dropout; None: all). Every patch is embedded either way."""
        c = self.cfg
        tokens = self.num_tokens if kept is None else kept + self.num_prefix
        patch = 2 * c.num_patches * 3 * c.patch_size**2 * c.width
        return patch + c.depth * block_flops(tokens, c.width, c.mlp_ratio) + self._head_flops(tokens)

    def _head_flops(self, n: int) -> float:
        """The attention-pool head: one query (q, out, MLP) over the ``n`` tokens' keys and values;
        or the attentional pooler's queries (q, out) over them."""
        if self.pooler is not None:
            q, w = self.cfg.pool_queries, self.width
            return 2.0 * (2 * q * w * w + 2 * n * self.cfg.width * w + 2 * q * n * w)
        if self.head is None:
            return 0.0
        c = self.cfg
        hidden = mlp_width(c.width, c.mlp_ratio)
        return 2.0 * (2 * c.width**2 + 2 * n * c.width**2 + 2 * n * c.width + 2 * c.width * hidden)


def _as_is(x: torch.Tensor, real: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The blocks' output of images one to a row: already laid out as the tower returns it."""
    return x, real


class PatchDropout(nn.Module):
    """Patch dropout: the blocks see only the patches each image keeps (``Images.keep`` [B, K],
    ascending), after their positions are added. Which ones is drawn keyed by the step and the
    sample (``Objectives.patch_keep``, :func:`vltrain.pixels.kept_patches`), and the step hands them
    in with the images; outside training there are none and every patch is seen. No parameters."""

    def __init__(self, prefix: int):
        super().__init__()
        self.prefix = prefix

    def forward(self, x: torch.Tensor, keep: torch.Tensor | None, prefix: int | None = None) -> torch.Tensor:
        """The class token (``prefix`` positions, the tower's by default) and the kept patches of each
        row of ``x`` [B, prefix + N, ...] (tokens or their mask): [B, prefix + K, ...]; ``x`` itself
        when every patch is kept."""
        if keep is None:
            return x
        prefix = self.prefix if prefix is None else prefix
        index = keep.view(*keep.shape, *(1,) * (x.dim() - 2)).expand(-1, -1, *x.shape[2:])
        return torch.cat([x[:, :prefix], x[:, prefix:].gather(1, index)], dim=1)

    def sequences(self, images: Images) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Packed images' (pixels, segments, patch_index), each sequence keeping only its images' kept
        patches and shortened to them (:func:`vltrain.pixels.drop_packed`); as they are when every
        patch is kept."""
        if images.keep is None:
            return images.pixels, images.segments, images.patch_index
        return drop_packed(images.pixels, images.real, images.segments, images.patch_index, images.keep,
                           images.slots.shape[1])


class AttentionPool(nn.Module):
    """Multihead attention pooling (SigLIP's head): a learned probe attends over every token, then a
    residual MLP; the probe's output is the pooled vector. ``qkv`` holds the query, key and value
    projections in one matrix, as ``nn.MultiheadAttention``'s in_proj does (the query third applies
    to the probe, the rest to the tokens)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.heads = cfg.heads
        self.probe = nn.Parameter(torch.randn(1, 1, cfg.width) * cfg.width**-0.5)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.out = nn.Linear(cfg.width, cfg.width)
        self.norm = LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.mlp = MLP(cfg.width, mlp_width(cfg.width, cfg.mlp_ratio), cfg.act)

    def forward(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """``real`` [B, tokens] (bool): the tokens the probe may attend to (None: all)."""
        b, n, w = x.shape
        h, d = self.heads, w // self.heads
        wq, wkv = self.qkv.weight.split([w, 2 * w])
        bq, bkv = self.qkv.bias.split([w, 2 * w])
        q = F.linear(self.probe.to(x.dtype), wq, bq).expand(b, 1, w).reshape(b, 1, h, d).transpose(1, 2)
        k, v = F.linear(x, wkv, bkv).view(b, n, 2, h, d).permute(2, 0, 3, 1, 4)
        mask = None if real is None else real[:, None, None, :]
        y = self.out(attention(q, k, v, mask).transpose(1, 2).reshape(b, 1, w))
        return (y + self.mlp(self.norm(y)))[:, 0]


def axis_weights(cells: torch.Tensor, grid: int, index: torch.Tensor,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, length, grid]: how much each of ``grid`` table cells gives to output cell ``index`` of an
    axis resized to ``cells`` [B] cells: a triangle filter as wide as the larger of one output cell
    and one table cell, normalized, centres aligned (``F.interpolate``'s bilinear with antialias,
    ``align_corners=False``)."""
    step = grid / cells.to(dtype)[:, None]  # table cells per output cell
    width = step.clamp(min=1.0)
    centre = (index.to(dtype) + 0.5) * step - 0.5
    source = torch.arange(grid, dtype=dtype, device=cells.device)
    w = (1.0 - (source - centre[..., None]).abs() / width[..., None]).clamp(min=0.0)
    return w / w.sum(dim=-1, keepdim=True)


def resized_table(table: torch.Tensor, prefix: int, grid: int, new_grid: int) -> torch.Tensor:
    """A square position table [prefix + grid², W] for a ``new_grid`` x ``new_grid`` image: the
    prefix rows (the class token's) kept, the patch rows resized as images at their own shape resize
    them (:func:`resize_positions`), in the table's dtype."""
    grids = torch.tensor([[new_grid, new_grid]], device=table.device)
    patches = resize_positions(table[prefix:], grid, grids, new_grid * new_grid)[0]
    return torch.cat([table[:prefix], patches.to(table.dtype)])


def resize_positions(table: torch.Tensor, grid: int, grids: torch.Tensor, length: int) -> torch.Tensor:
    """A square ``grid`` x ``grid`` position table [grid², W], resized to each image's grid [B, 2]
    (bilinear, antialiased) and laid out row by row: [B, length, W], padding positions taking the
    first cell's value.

    Resizing is linear in the table, so each position is a weighted sum of the table's cells: one
    matmul of fixed shape for the whole batch, whatever the grids (no per-shape graph, no host
    sync), computed in fp32 (fp64 in an fp64 run)."""
    position = torch.arange(length, device=grids.device)[None, :]
    rows, cols = grids[:, :1], grids[:, 1:]
    inside = position < rows * cols
    row = torch.where(inside, position // cols, 0)
    col = torch.where(inside, position % cols, 0)
    table = at_least_fp32(table)
    wy = axis_weights(grids[:, 0], grid, row, table.dtype)
    wx = axis_weights(grids[:, 1], grid, col, table.dtype)
    weights = (wy[..., :, None] * wx[..., None, :]).flatten(2)  # [B, length, grid²]
    with torch.autocast(table.device.type, enabled=False):
        return weights.to(table.device) @ table


class AttentionalPooler(nn.Module):
    """OpenCLIP's CoCa pooler: ``pool_queries`` learned queries (normed) attend over the normed tokens.
    Queries of width ``width``; keys and values projected from the tower's width (``kv``, as
    ``nn.MultiheadAttention`` with ``kdim`` does)."""

    def __init__(self, cfg: VisionConfig, width: int):
        super().__init__()
        self.heads = cfg.pool_heads
        self.query = nn.Parameter(torch.randn(cfg.pool_queries, width) * width**-0.5)
        self.norm_q = LayerNorm(width, eps=cfg.norm_eps)
        self.norm_k = LayerNorm(cfg.width, eps=cfg.norm_eps)
        self.q = nn.Linear(width, width)
        self.kv = nn.Linear(cfg.width, 2 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, real: torch.Tensor | None = None) -> torch.Tensor:
        """[B, queries, width] from the tokens ``x`` [B, N, W]; ``real`` [B, N] (bool): the ones to read."""
        b, n, _ = x.shape
        q_count, w = self.query.shape
        h, d = self.heads, w // self.heads
        q = self.q(self.norm_q(self.query)).view(1, q_count, h, d).transpose(1, 2).expand(b, -1, -1, -1)
        k, v = self.kv(self.norm_k(x)).view(b, n, 2, h, d).permute(2, 0, 3, 1, 4)
        mask = None if real is None else real[:, None, None, :]
        return self.out(attention(q, k, v, mask).transpose(1, 2).reshape(b, q_count, w))
