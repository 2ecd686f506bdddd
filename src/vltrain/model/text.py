"""Text towers: our own pre-norm transformer encoder, or a Hugging Face encoder from a local folder.

Both return every token (for fusion and MLM) and a pooled vector (for the contrastive embedding),
and expose ``token_embedding`` (the input embedding matrix, tied to the MLM decoder) and ``blocks``
(for activation checkpointing and per-block sharding).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.errors import UserError
from vltrain.model.blocks import (
    Block,
    LayerCache,
    LayerNorm,
    Packed,
    PostNormBlock,
    block_flops,
    in_autocast_dtype,
    key_padding_mask,
    run_blocks,
    text_mask,
)


@dataclass
class TextTowerConfig:
    vocab_size: int = 49408
    max_length: int = 77
    width: int = 512
    depth: int = 12
    heads: int = 8
    mlp_ratio: float = 4.0
    pooling: str = "eos"
    """first (token 0, e.g. [CLS]) | eos (the last non-padding token) | mean (of non-padding tokens)
    | last (the last position, padding or not: SigLIP) | appended (a learned class token appended
    after the text padded to ``max_length``, as OpenCLIP's CoCa pools: see
    :meth:`TextTransformer._forward_appended`)."""
    causal: bool = False
    """Causal self-attention, as in CLIP's text tower (pair it with eos pooling)."""
    act: str = "gelu"
    """MLP activation: gelu | gelu_tanh | quick_gelu (``vltrain.model.blocks.ACTIVATIONS``)."""
    norm_eps: float = 1e-5
    pad_to_max_length: bool = False
    """Encode every text padded with ``pad_id`` to ``max_length``, every position attending to every
    other (SigLIP: trained on fixed-length text, it pools the last position). The tower pads itself,
    so no collator or tokenizer setting can get it wrong."""
    pad_id: int = 0
    """The padding token of ``pad_to_max_length`` (the checkpoint's own)."""
    embed_norm: bool = False
    """A layer norm over the token and position embeddings, before the blocks (BERT's)."""
    post_norm: bool = False
    """BERT's layers (each sublayer's residual, then its norm: :class:`PostNormBlock`), hence no
    norm after the last one. BLIP's text towers."""
    start_id: int | None = None
    """The id read at position 0 in place of the tokenizer's start token, and the one captions are
    generated from (BLIP's captioning decoder reads its [DEC] token, ``bos_token_id``, there);
    None: the ids as they are."""
    layout: str = "auto"
    """auto | packed | padded: run the tower's token-wise layers over the batch's text tokens only,
    packed, rather than over the batch padded to its longest text (``packed_tokens``); auto: on a
    CPU, when that skips a fifth of the positions or more. Each row's pooled vector and its tokens
    at text positions are the same (to float rounding); tokens at padding positions come back
    zero, and every consumer masks those out. Not with ``last`` pooling, which reads the batch's
    last position."""
    pack_multiple: int = 1
    """Packed, the token count rounded up to a multiple of this with padding positions (whose
    results are dropped), so that a run's matrix sizes repeat instead of changing with every
    batch's captions (``packed_tokens``)."""


def _eos(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
    return tokens[torch.arange(tokens.shape[0], device=tokens.device), last]


def _mean(tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    m = attention_mask.to(tokens.dtype).unsqueeze(-1)
    return (tokens * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)


_POOL = {"first": lambda tokens, attention_mask: tokens[:, 0], "eos": _eos, "mean": _mean,
         "last": lambda tokens, attention_mask: tokens[:, -1]}
POOLINGS = (*_POOL, "appended")
"""The text poolings; ``model.text.pooling`` is checked against these when the config is loaded."""


def pool(tokens: torch.Tensor, attention_mask: torch.Tensor, pooling: str) -> torch.Tensor:
    return _POOL[pooling](tokens, attention_mask)


MIN_SAVING = 0.2
"""The share of padded positions that ``layout: auto`` must skip to pack the tokens."""
TEXT_LAYOUTS = ("auto", "packed", "padded")


def packed_tokens(attention_mask: torch.Tensor, layout: str, multiple: int = 1) -> Packed | None:
    """The text tokens of a padded batch, to run packed (``Packed``), or None to run it padded.

    A batch of captions padded to its longest spends much of the text tower on padding (captions
    of 8 to 32 tokens: about a third). Packed, the projections and MLPs, nearly all of the tower's
    work, run over the text tokens alone, and only attention sees the padded layout. Position 0
    of every row is kept, so a row without text gives the same finite vector as padded. ``auto``
    packs on a CPU only: on a GPU, finding the tokens waits for the device, and the step is bound
    by kernel launches at the sizes where padding costs most
    (``docs/benchmarks/cpu-training.md#one-step-against-transformers``).
    """
    if layout == "padded" or (layout == "auto" and attention_mask.device.type != "cpu"):
        return None
    keep = attention_mask.bool().clone()
    keep[:, 0] = True
    index = keep.reshape(-1).nonzero().squeeze(1)
    if layout == "auto" and len(index) > (1 - MIN_SAVING) * keep.numel():
        return None
    real = len(index)
    extra = min(-real % multiple, keep.numel() - real)
    if extra:
        index = torch.cat([index, (~keep).reshape(-1).nonzero().squeeze(1)[:extra]])
    return Packed(index, keep.shape[0], keep.shape[1], None, real)


class TextTransformer(nn.Module):
    """Our own text tower. Built with ``image_width`` (BLIP's text encoder, under a shared fusion:
    ``FusionConfig.shared``), its post-norm layers also cross-attend to image tokens in the fusion
    pass (:meth:`fuse`), and encoding text alone hands on the embedded tokens that pass starts from
    (the pooled vector is the text-only output's, as ever)."""

    def __init__(self, cfg: TextTowerConfig, image_width: int = 0):
        super().__init__()
        if image_width and not cfg.post_norm:
            raise ValueError("only a post-norm text tower's layers cross-attend (a shared fusion)")
        self.cfg = cfg
        self.width = cfg.width
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.width)
        appended = cfg.pooling == "appended"
        self.pos_embed = nn.Parameter(torch.randn(cfg.max_length + appended, cfg.width) * 0.01)
        self.cls_token = nn.Parameter(torch.randn(cfg.width) * 0.01) if appended else None
        self.embed_norm = LayerNorm(cfg.width, eps=cfg.norm_eps) if cfg.embed_norm else None
        self.fuses = bool(image_width)
        self.blocks = nn.ModuleList(
            PostNormBlock(cfg.width, cfg.heads, cfg.mlp_ratio, cfg.act, cfg.norm_eps, image_width) if cfg.post_norm
            else Block(cfg.width, cfg.heads, cfg.mlp_ratio, cfg.act, cfg.norm_eps) for _ in range(cfg.depth)
        )
        self.norm = None if cfg.post_norm else LayerNorm(cfg.width, eps=cfg.norm_eps)
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.checkpointing = False

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.start_id is not None:
            input_ids = self.started(input_ids)
        if self.cfg.pad_to_max_length:
            return self._forward_fixed_length(input_ids, attention_mask)
        if self.cls_token is not None:
            return self._forward_appended(input_ids, attention_mask)
        last = self.cfg.pooling == "last"  # reads the batch's last position: the padded layout
        layout = "padded" if last else self.cfg.layout
        packed = packed_tokens(attention_mask, layout, self.cfg.pack_multiple)
        if packed is None:
            mask = (key_padding_mask if last else text_mask)(attention_mask, self.cfg.causal)
            embedded = self._embed(input_ids)
            x = self._last(run_blocks(self.blocks, embedded, mask, checkpointing=self.checkpointing))
            return embedded if self.fuses else x, pool(x, attention_mask, self.cfg.pooling)
        packed.mask = key_padding_mask(attention_mask, self.cfg.causal)
        n = input_ids.shape[1]
        x = self.token_embedding(input_ids.reshape(-1)[packed.index]) + self.pos_embed.index_select(0, packed.index % n)
        x = self._embedded(x)
        x = self._last(run_blocks(self.blocks, x, packed, checkpointing=self.checkpointing))
        tokens = packed.unpack(x[: packed.real])
        return self._embed(input_ids) if self.fuses else tokens, pool(tokens, attention_mask, self.cfg.pooling)

    def fuse(self, embedded: torch.Tensor, mask: torch.Tensor, image: torch.Tensor,
             image_mask: torch.Tensor | None) -> torch.Tensor:
        """The fusion pass (a tower built with ``image_width``): its layers over the embedded tokens
        [B, L, W] that :meth:`forward` handed on, attending to each other (``mask``) and to the image
        tokens (``image_mask``: the real ones, attention form; None: all)."""
        return run_blocks(self.blocks, embedded, mask, image, image_mask, checkpointing=self.checkpointing)

    def started(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` with ``start_id`` at position 0 (the tokenizer's start token replaced)."""
        start = input_ids.new_full((input_ids.shape[0], 1), self.cfg.start_id)
        return torch.cat([start, input_ids[:, 1:]], dim=1)

    def step(self, input_ids: torch.Tensor, caches: list[LayerCache], start: int) -> torch.Tensor:
        """The tokens [B, n, W] of ``n`` new positions from position ``start`` on, given every
        block's cached keys and values of the positions before them, which grow by the new ones
        (generation; a causal tower only)."""
        n = input_ids.shape[1]
        if start == 0 and self.cfg.start_id is not None:
            input_ids = self.started(input_ids)
        x = self._embedded(self.token_embedding(input_ids) + self.pos_embed[start : start + n])
        for blk, cache in zip(self.blocks, caches):
            x = blk(x, cache)
        return x if self.cls_token is not None else self._last(x)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._embedded(self.token_embedding(input_ids) + self.pos_embed[: input_ids.shape[1]])

    def _embedded(self, x: torch.Tensor) -> torch.Tensor:
        """Token and position embeddings summed, as the blocks read them."""
        return in_autocast_dtype(x if self.embed_norm is None else self.embed_norm(x))

    def _last(self, x: torch.Tensor) -> torch.Tensor:
        """The blocks' output as the tower gives it: normed, unless its blocks end in a norm."""
        return x if self.norm is None else self.norm(x)

    def _forward_fixed_length(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """Every row padded with ``pad_id`` to ``max_length`` and attended in full; the tokens come
        back at the batch's own width."""
        n, c = input_ids.shape[1], self.cfg
        ids = F.pad(torch.where(attention_mask.bool(), input_ids, c.pad_id), (0, c.max_length - n), value=c.pad_id)
        mask = F.pad(attention_mask, (0, c.max_length - n))
        x = self.token_embedding(ids) + self.pos_embed
        x = self.norm(run_blocks(self.blocks, x, None, checkpointing=self.checkpointing))
        return x[:, :n], pool(x, mask, c.pooling)

    def _forward_appended(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        """OpenCLIP's CoCa text tower: every row padded with ``pad_id`` to ``max_length``, a class
        token appended after it, causal attention, and the class token's output (normed) pooled. The
        tokens come back un-normed (the decoder reads them so) at the batch's own width; causal, they
        do not depend on the padding or the class token.

        The keys follow OpenCLIP's padding mask, which is shifted by one position (open_clip 3.3,
        ``correct_cls_mask`` False, the setting its CoCa weights were trained with): position 0 is
        always a key, position ``j`` is one when text position ``j - 1`` is real, and the class token
        reads itself only when the text fills ``max_length``. Real positions are those of
        ``attention_mask``, where OpenCLIP takes every token other than ``pad_id``: the two differ
        only where a caption holds the padding token itself."""
        (b, n), c = input_ids.shape, self.cfg
        ids = F.pad(torch.where(attention_mask.bool(), input_ids, c.pad_id), (0, c.max_length - n), value=c.pad_id)
        real = F.pad(attention_mask.bool(), (0, c.max_length - n))
        x = torch.cat([self.token_embedding(ids), self.cls_token.expand(b, 1, -1)], dim=1)
        x = in_autocast_dtype(x + self.pos_embed)
        keys = torch.cat([real.new_ones(b, 1), real], dim=1)
        causal = torch.ones(c.max_length + 1, c.max_length + 1, dtype=torch.bool, device=x.device).tril()
        x = run_blocks(self.blocks, x, keys[:, None, None, :] & causal, checkpointing=self.checkpointing)
        return x[:, :n], self.norm(x[:, -1])

    def flops(self, length: int) -> float:
        c = self.cfg
        if c.pooling == "appended":  # the text padded to max_length, and the class token
            length = c.max_length + 1
        elif c.pad_to_max_length:
            length = c.max_length
        return c.depth * block_flops(length, c.width, c.mlp_ratio)


def hf_tokenizer_file(hf_path: str | Path) -> Path:
    """The tokenizer.json that belongs to a Hugging Face encoder folder (the text must be tokenized
    with the encoder's own vocabulary)."""
    path = Path(hf_path, "tokenizer.json")
    if not path.is_file():
        raise UserError(
            f"model.text.hf_path {hf_path}: no tokenizer.json there; save the encoder with its fast tokenizer "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(folder))"
        )
    return path


class HFTextEncoder(nn.Module):
    """Any Hugging Face encoder (BERT, MiniLM, ...) loaded from a local folder with ``transformers``.

    Dropout is switched off, as in our own towers, so that re-running the encoder (gradient-cached
    accumulation) reproduces the first pass exactly. A pooler head, if the model has one, is dropped:
    it would be a parameter without a gradient, which distributed data parallel cannot accept.
    """

    def __init__(self, path: str | Path, pooling: str = "first", max_length: int | None = None):
        super().__init__()
        try:
            from transformers import AutoModel
        except ImportError:
            raise UserError("model.text.hf_path needs the transformers package: pip install 'vltrain[hf]'") from None
        if not Path(path, "config.json").is_file():
            raise UserError(f"model.text.hf_path {path}: no config.json there; give a saved Hugging Face model folder")
        # from_pretrained returns the encoder in eval mode; a tower is built for training (transformers
        # checkpoints activations only in training mode), and evaluation switches modes itself
        self.model = AutoModel.from_pretrained(str(path)).train()
        if getattr(self.model, "pooler", None) is not None:
            self.model.pooler = None
        for m in self.model.modules():
            if isinstance(m, nn.Dropout):
                m.p = 0.0
        config = self.model.config
        limit = getattr(config, "max_position_embeddings", None)
        if max_length is not None and limit is not None and max_length > limit:
            raise UserError(f"data text length {max_length} exceeds {path}'s max_position_embeddings {limit}")
        self.pooling = pooling
        self.width = config.hidden_size
        self.checkpointing = False

    @property
    def token_embedding(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def blocks(self) -> list[nn.Module]:
        encoder = getattr(self.model, "encoder", None)
        return list(getattr(encoder, "layer", []))

    def set_checkpointing(self, enabled: bool) -> None:
        # transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*
        prefix = "activation" if hasattr(self.model, "activation_checkpointing_enable") else "gradient"
        if enabled:
            kwargs = {f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}
            getattr(self.model, f"{prefix}_checkpointing_enable")(**kwargs)
        elif self.checkpointing:
            getattr(self.model, f"{prefix}_checkpointing_disable")()
        self.checkpointing = enabled

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = attention_mask.clone()
        mask[:, 0] = 1  # rows without text stay finite (they are masked out of every loss)
        x = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
        return x, pool(x, attention_mask, self.pooling)

    def flops(self, length: int) -> float:
        """Dense approximation: 2 FLOPs per non-embedding weight per token, plus attention."""
        dense = sum(p.numel() for n, p in self.model.named_parameters() if p.ndim == 2 and "embeddings" not in n)
        layers = len(self.blocks)
        return float(2 * dense * length + layers * 4 * length * length * self.width)
