"""The vision-language model: given its towers (and optionally a fusion encoder), it encodes, scores
and computes every objective.

Every rank runs the same graph whatever its batch holds. A tower whose modality is absent from the
whole local batch runs on one dummy row, and every tower output enters the loss through ``anchor``
(zero times its mean): each parameter then receives a gradient (zero where there was no data), so
DDP with ``find_unused_parameters=False`` and FSDP2's collectives match on every rank, and the
result is exactly that of skipping the tower. When some rows lack a modality, the tower runs only on
the rows that have it (one host synchronization per tower per step: the count of such rows).

The split ``encode`` / ``contrastive_loss`` / ``objectives`` serves gradient-cached accumulation:
``forward == objectives(encode(...))``; with ``contrastive=False`` the objectives hold everything but
the contrastive term, so (cached-embedding surrogate) + objectives(..., contrastive=False) has the
exact gradient. No module uses dropout or other randomness in ``encode``, so replaying it is exact;
ITM negative sampling and MLM masking draw from the default torch generator in ``objectives``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from vltrain.distributed import all_gather_no_grad, all_gather_with_grad, exchange_shapes, pad_to
from vltrain.errors import UserError
from vltrain.losses import itc_loss, itm_loss, mask_tokens, mlm_loss, sample_negatives, scale_of, siglip_loss
from vltrain.model.config import LossConfig
from vltrain.model.fusion import FusionEncoder
from vltrain.model.heads import ITMHead, MLMHead, Projection
from vltrain.ring import itc_loss_ring, siglip_loss_ring


@dataclass
class Encoded:
    image_embeds: torch.Tensor
    """[B, D] L2-normalized; zero rows where there is no image."""
    text_embeds: torch.Tensor
    """[B, D] L2-normalized; zero rows where there is no text."""
    image_tokens: torch.Tensor | None
    """[B, N, Wv] the vision tower's tokens (fusion models only); zeros where there is no image."""
    text_tokens: torch.Tensor | None
    """[B, L, Wt] the text tower's tokens (fusion models only); zeros where there is no text."""
    anchor: torch.Tensor
    """A zero scalar connected to every parameter ``encode`` used."""


@dataclass
class ModelOutput:
    loss: torch.Tensor
    """Weighted sum of ``losses`` (plus the zero-valued anchor)."""
    losses: dict[str, torch.Tensor]
    """Unweighted per-objective values: itc, siglip, itm, mlm (those the model has)."""
    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    logit_scale: torch.Tensor
    """exp(logit_scale), clamped: the inverse temperature in use."""
    itm_logits: torch.Tensor | None = None


@dataclass
class ITMPairs:
    """The 3B fusion inputs of one ITM step: B positives, B (image, hard negative text), B (hard
    negative image, text)."""

    text_tokens: torch.Tensor
    attention_mask: torch.Tensor
    image_tokens: torch.Tensor
    labels: torch.Tensor
    weights: torch.Tensor
    negative_text_ids: torch.Tensor
    negative_image_ids: torch.Tensor


@dataclass
class LossWeights:
    """Effective loss weights: those of ``LossConfig`` the model has heads for."""

    weights: dict[str, float] = field(default_factory=dict)
    mlm_probability: float = 0.15
    itm_negatives: str = "local"
    """Where ITM draws hard negatives: the rank's own batch (local) or every rank's (global)."""
    contrastive_impl: str = "gather"
    """gather (losses.py) or ring (ring.py): how ITC and SigLIP reach the other ranks' columns."""

    @staticmethod
    def from_config(loss: LossConfig, has_fusion: bool) -> "LossWeights":
        w = {"itc": loss.itc, "siglip": loss.siglip}
        if has_fusion:
            w.update(itm=loss.itm, mlm=loss.mlm)
        return LossWeights({k: v for k, v in w.items() if v > 0}, loss.mlm_probability, loss.itm_negatives,
                           loss.contrastive_impl)


@dataclass
class _Columns:
    """What ITM draws its negatives from: this rank's batch, or every rank's (rank order)."""

    image_tokens: torch.Tensor
    text_tokens: torch.Tensor
    attention_mask: torch.Tensor
    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    ids: torch.Tensor
    has_image: torch.Tensor
    has_text: torch.Tensor

    @staticmethod
    def gather(enc: Encoded, attention_mask, has_image, has_text, ids, global_: bool) -> "_Columns":
        meta = torch.stack([ids, has_image.long(), has_text.long()], dim=1)
        parts = (enc.image_tokens, enc.text_tokens, attention_mask, enc.image_embeds, enc.text_embeds, meta)
        if global_:
            shapes = exchange_shapes(*parts)  # one exchange; text widths differ between ranks
            grad = (True, True, False, False, False, False)
            parts = tuple((all_gather_with_grad if g else all_gather_no_grad)(x, s)
                          for x, s, g in zip(parts, shapes, grad))
        *tensors, meta = parts
        return _Columns(*tensors, meta[:, 0], meta[:, 1].bool(), meta[:, 2].bool())


class VLModel(nn.Module):
    """Vision and text towers with projections to a shared space, a learnable temperature (and SigLIP
    bias), and, for fusion models, a fusion encoder with ITM and MLM heads; built by ``build_model``."""

    def __init__(
        self,
        vision: nn.Module,
        text: nn.Module,
        embed_dim: int,
        weights: LossWeights,
        *,
        fusion: FusionEncoder | None = None,
        vocab_size: int,
        pad_id: int,
        mask_id: int | None = None,
        max_text_length: int,
        siglip_bias: bool = True,
    ):
        super().__init__()
        self.vision = vision
        self.text = text
        self.image_proj = Projection(vision.width, embed_dim)
        self.text_proj = Projection(text.width, embed_dim)
        self.weights = dict(weights.weights)
        self.mlm_probability = weights.mlm_probability
        self.itm_negatives = weights.itm_negatives
        self.ring = weights.contrastive_impl == "ring"
        contrastive_only_siglip = "siglip" in self.weights and "itc" not in self.weights
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0) if contrastive_only_siglip else math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0)) if "siglip" in self.weights and siglip_bias else None
        self.fusion = fusion if ("itm" in self.weights or "mlm" in self.weights) else None
        self.itm_head = ITMHead(fusion.width) if self.fusion is not None and "itm" in self.weights else None
        self.mlm_head = None
        if self.fusion is not None and "mlm" in self.weights:
            if mask_id is None:
                raise UserError("model.loss.mlm > 0 needs a tokenizer with a mask token; set model.loss.mlm=0 or use one")
            self.mlm_head = MLMHead(text.width, text.token_embedding)
        self.embed_dim = embed_dim
        self.vocab_size, self.pad_id, self.mask_id = vocab_size, pad_id, mask_id
        self.max_text_length = max_text_length

    # -- encoding -----------------------------------------------------------------------------

    def _vision(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, pooled = self.vision(pixels)
        return tokens, self.image_proj(pooled)

    def _text(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, pooled = self.text(input_ids, attention_mask)
        return tokens, self.text_proj(pooled)

    def _encode_present(self, fn, inputs: tuple, dummy: tuple, present: torch.Tensor):
        """Run ``fn`` on the rows where ``present`` (or on ``dummy`` when there is none); scatter the
        results back to the full batch with zero rows elsewhere. Returns (tokens | None, embeds, anchor)."""
        b = present.shape[0]
        index = present.nonzero().squeeze(1)
        n = index.numel()
        if n == b:
            tokens, embeds = fn(*inputs)
        else:
            tokens, embeds = fn(*(dummy if n == 0 else (x.index_select(0, index) for x in inputs)))
        anchor = 0.0 * (tokens.float().mean() + embeds.float().mean())
        keep = self.fusion is not None
        if n == b:
            return (tokens if keep else None), embeds, anchor
        if n == 0:
            # zeros that stay in the graph: a later gather-with-grad must run its backward on every rank
            full_embeds = (0.0 * embeds[:1]).expand(b, -1)
            full_tokens = (0.0 * tokens[:1]).expand(b, *tokens.shape[1:]) if keep else None
            return full_tokens, full_embeds, anchor
        full_embeds = embeds.new_zeros(b, embeds.shape[1]).index_copy(0, index, embeds)
        full_tokens = tokens.new_zeros((b, *tokens.shape[1:])).index_copy(0, index, tokens) if keep else None
        return full_tokens, full_embeds, anchor

    def encode(self, pixels, input_ids, attention_mask, has_image, has_text) -> Encoded:
        image_tokens, image_embeds, a_img = self._encode_present(
            self._vision, (pixels,), (torch.zeros_like(pixels[:1]),), has_image
        )
        text_tokens, text_embeds, a_txt = self._encode_present(
            self._text, (input_ids, attention_mask), (input_ids[:1], torch.ones_like(attention_mask[:1])), has_text
        )
        return Encoded(image_embeds, text_embeds, image_tokens, text_tokens, a_img + a_txt)

    # -- objectives ---------------------------------------------------------------------------

    def contrastive_losses(self, image_embeds, text_embeds, has_image, has_text, ids, weights=None) -> dict[str, torch.Tensor]:
        out = {}
        itc, siglip = (itc_loss_ring, siglip_loss_ring) if self.ring else (itc_loss, siglip_loss)
        if "itc" in self.weights:
            out["itc"] = itc(image_embeds, text_embeds, self.logit_scale, has_image, has_text, ids, weights)
        if "siglip" in self.weights:
            out["siglip"] = siglip(
                image_embeds, text_embeds, self.logit_scale, self.logit_bias, has_image, has_text, ids, weights
            )
        return out

    def contrastive_loss(self, image_embeds, text_embeds, has_image, has_text, ids, weights=None) -> torch.Tensor:
        """The weighted ITC + SigLIP term on given (e.g. cached, concatenated) embeddings."""
        losses = self.contrastive_losses(image_embeds, text_embeds, has_image, has_text, ids, weights)
        return sum(self.weights[k] * v for k, v in losses.items())

    def itm_pairs(self, enc: Encoded, attention_mask, has_image, has_text, ids) -> ITMPairs:
        """Positives and hard negatives drawn from the similarity matrix of the rank's own batch
        (``itm_negatives: local``) or of the global batch (``global``).

        With global negatives the token features of every rank are gathered with a gradient path,
        so a negative from another rank trains that rank's encoders exactly as in one process with
        the global batch. Ranks pad their captions to their own longest, so the gathered text
        tokens and masks are padded to the longest over ranks (masked, so the fusion ignores them),
        and this rank's own rows with them.
        """
        b = ids.shape[0]
        cols = _Columns.gather(enc, attention_mask, has_image, has_text, ids, self.itm_negatives == "global")
        text_tokens = pad_to(enc.text_tokens, (b, *cols.text_tokens.shape[1:]))
        attention_mask = pad_to(attention_mask, (b, cols.attention_mask.shape[1]))
        with torch.no_grad():
            scale = scale_of(self.logit_scale)
            sim_i2t = scale * enc.image_embeds.detach().float() @ cols.text_embeds.float().t()
            sim_t2i = scale * enc.text_embeds.detach().float() @ cols.image_embeds.float().t()
        neg_text, text_found = sample_negatives(sim_i2t, ids, cols.ids, cols.has_text)
        neg_image, image_found = sample_negatives(sim_t2i, ids, cols.ids, cols.has_image)
        valid = (has_image & has_text).float()
        return ITMPairs(
            text_tokens=torch.cat([text_tokens, cols.text_tokens[neg_text], text_tokens]),
            attention_mask=torch.cat([attention_mask, cols.attention_mask[neg_text], attention_mask]),
            image_tokens=torch.cat([enc.image_tokens, enc.image_tokens, cols.image_tokens[neg_image]]),
            labels=torch.cat([torch.ones(b, dtype=torch.long, device=ids.device), ids.new_zeros(2 * b)]),
            weights=torch.cat([valid, valid * text_found, valid * image_found]),
            negative_text_ids=cols.ids[neg_text],
            negative_image_ids=cols.ids[neg_image],
        )

    def _itm(self, enc: Encoded, attention_mask, has_image, has_text, ids, weights):
        pairs = self.itm_pairs(enc, attention_mask, has_image, has_text, ids)
        fused = self.fusion(pairs.text_tokens, pairs.attention_mask, pairs.image_tokens)
        logits = self.itm_head(fused)
        w = pairs.weights if weights is None else pairs.weights * weights.float().repeat(3)
        return itm_loss(logits, pairs.labels, w), logits

    def _mlm(self, enc: Encoded, input_ids, attention_mask, has_image, has_text, weights):
        masked, labels = mask_tokens(
            input_ids, attention_mask, mask_id=self.mask_id, vocab_size=self.vocab_size, pad_id=self.pad_id,
            probability=self.mlm_probability,
        )
        labels = labels.masked_fill(~(has_image & has_text)[:, None], -100)
        tokens, _ = self.text(masked, attention_mask)
        fused = self.fusion(tokens, attention_mask, enc.image_tokens)
        return mlm_loss(self.mlm_head(fused), labels, weights)

    def objectives(
        self, enc: Encoded, input_ids, attention_mask, has_image, has_text, ids, weights=None, contrastive: bool = True
    ) -> ModelOutput:
        anchor = enc.anchor
        losses: dict[str, torch.Tensor] = {}
        if contrastive:
            losses.update(self.contrastive_losses(enc.image_embeds, enc.text_embeds, has_image, has_text, ids, weights))
        else:  # the contrastive term is computed elsewhere; keep its parameters in this graph
            anchor = anchor + 0.0 * self.logit_scale
            if self.logit_bias is not None:
                anchor = anchor + 0.0 * self.logit_bias
        itm_logits = None
        if self.itm_head is not None:
            losses["itm"], itm_logits = self._itm(enc, attention_mask, has_image, has_text, ids, weights)
        if self.mlm_head is not None:
            losses["mlm"] = self._mlm(enc, input_ids, attention_mask, has_image, has_text, weights)
        total = anchor + sum(self.weights[k] * v for k, v in losses.items())
        return ModelOutput(
            total, losses, enc.image_embeds, enc.text_embeds, scale_of(self.logit_scale).detach(), itm_logits
        )

    def forward(self, pixels, input_ids, attention_mask, has_image, has_text, ids, weights=None) -> ModelOutput:
        enc = self.encode(pixels, input_ids, attention_mask, has_image, has_text)
        return self.objectives(enc, input_ids, attention_mask, has_image, has_text, ids, weights)

    # -- for the trainer ----------------------------------------------------------------------

    def no_weight_decay(self) -> set[str]:
        """Norms, biases, embeddings, positions, class token and the temperature/bias scalars."""
        skip = ("token_embedding", "pos_embed", "cls_token", "logit_scale", "logit_bias", "embeddings")
        return {n for n, p in self.named_parameters() if p.ndim < 2 or any(s in n for s in skip)}

    def set_activation_checkpointing(self, enabled: bool) -> None:
        for tower in (self.vision, self.text, self.fusion):
            if tower is None:
                continue
            if hasattr(tower, "set_checkpointing"):
                tower.set_checkpointing(enabled)
            else:
                tower.checkpointing = enabled

    def blocks_for_sharding(self) -> list[nn.Module]:
        """Transformer blocks in forward order (FSDP2 shards each one separately)."""
        blocks = list(self.vision.blocks) + list(self.text.blocks)
        return blocks + (list(self.fusion.blocks) if self.fusion is not None else [])

    def flops_per_sample(self, text_len: int | None = None) -> float:
        """Training FLOPs of one image-text sample: 3 x the forward matmul FLOPs (backward ~ 2x forward).

        The contrastive logits (2 x D per sample per global-batch column) are left out: they are
        negligible next to the towers at any batch size that fits in memory.
        """
        length = text_len or self.max_text_length
        f = self.vision.flops() + self.text.flops(length)
        f += 2 * (self.vision.width + self.text.width) * self.embed_dim
        if self.fusion is not None:
            n = self.vision.num_tokens
            if self.itm_head is not None:
                f += 3 * (self.fusion.flops(length, n) + 2 * self.fusion.width * 2)
            if self.mlm_head is not None:
                w = self.text.width
                f += self.text.flops(length) + self.fusion.flops(length, n) + 2 * length * (w * w + w * self.vocab_size)
        return 3.0 * f
