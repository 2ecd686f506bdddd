"""Loss functions: contrastive (ITC, SigLIP), image-text matching (ITM) and masked language modelling.

Parameter-free arithmetic on tensors; :mod:`vltrain.objectives.scoring` decides which of them a step computes,
on which rows and with which weights.

The contrastive losses are exact across ranks without materializing the global N x N matrix: each
rank scores only its own rows against every rank's columns (gathered with a gradient path), and the
loss is scaled so that, after DDP averages the gradients over ranks, every parameter holds exactly the
gradient of the global-batch loss. The value a rank returns is therefore ``world`` times its share
of the global loss; the mean of the ranks' values is the global loss (what a trainer should log).

Rows that lack the image or the text are masked out of the numerator and of the denominator, so
adding text-only or image-only rows to a batch changes neither the loss nor its gradient. Columns
whose sample id equals the row's (the same sample seen twice) are never treated as negatives.
All similarity arithmetic runs in fp32, whatever the autocast dtype of the encoders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vltrain.runtime.distributed import (
    all_gather_no_grad,
    all_gather_with_grad,
    all_reduce_sum,
    exchange_shapes,
    world_info,
)
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import Rows

MAX_LOGIT_SCALE = math.log(100.0)
_MASKED = -1e9  # finite, so rows with nothing valid stay NaN-free in forward and backward


def masked(logits: torch.Tensor, excluded: torch.Tensor) -> torch.Tensor:
    """``logits`` with the ``excluded`` ones set to ``_MASKED``, or under fp16 autocast (whose matmuls
    give fp16 logits, at most 65,504 in size) to a value fp16 holds with room for a log-sum-exp taken off."""
    return logits.masked_fill(excluded, -3e4 if logits.dtype == torch.float16 else _MASKED)


@dataclass
class GlobalBatch:
    """This rank's view of the global batch: where its rows sit, and every rank's ids and validity."""

    sizes: list[int]
    offset: int
    world: int
    ids: torch.Tensor
    """[N] sample ids of all ranks, rank order."""
    valid: torch.Tensor
    """[N] bool: the row has both an image and a text."""
    weight_total: torch.Tensor
    """Sum over all ranks of the weights of valid rows (fp32 scalar, no gradient)."""
    shapes: list[list[tuple[int, ...]]]
    """Every rank's shape of each tensor given to :meth:`build` after the weights (for the gathers)."""

    @staticmethod
    def build(ids: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor, *columns: torch.Tensor) -> "GlobalBatch":
        """One shape exchange covers the ids and every tensor in ``columns`` (to be gathered next)."""
        rank, world = world_info()
        meta = torch.stack([ids, valid.long()], dim=1)
        shapes = exchange_shapes(meta, *columns)
        sizes = [s[0] for s in shapes[0]]
        both = all_gather_no_grad(meta, shapes[0])
        total = all_reduce_sum((weights * valid).sum())
        return GlobalBatch(sizes, sum(sizes[:rank]), world, both[:, 0], both[:, 1].bool(), total, shapes[1:])

    def normalize(self, summed: torch.Tensor) -> torch.Tensor:
        """Local sum of weighted per-row losses -> this rank's term (see the module docstring)."""
        total = torch.where(self.weight_total > 0, self.weight_total, torch.ones_like(self.weight_total))
        return summed * self.world / total


def _row_weights(valid: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    w = valid.float()
    return w if weights is None else w * weights.float()


def scale_of(logit_scale: torch.Tensor) -> torch.Tensor:
    """exp(logit_scale), the inverse temperature, clamped at 100 as in CLIP."""
    return at_least_fp32(logit_scale).clamp(max=MAX_LOGIT_SCALE).exp()


def itc_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    rows: Rows,
    rows_out: list | None = None,
) -> torch.Tensor:
    """CLIP InfoNCE in both directions over the global batch; embeddings are L2-normalized [B, D].
    Rows with both sides take part, weighted by ``rows.row_weights``; a column with the row's id is
    never its negative. ``rows_out`` receives each row's unweighted loss (detached; for per-source
    metrics)."""
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w, image_embeds, text_embeds)
    all_images = all_gather_with_grad(at_least_fp32(image_embeds), g.shapes[0])
    all_texts = all_gather_with_grad(at_least_fp32(text_embeds), g.shapes[1])
    scale = scale_of(logit_scale)
    b = ids.shape[0]
    target = torch.arange(b, device=ids.device) + g.offset
    # negatives: valid columns whose id differs from the row's; the positive column stays.
    excluded = (ids[:, None] == g.ids[None, :]) | ~g.valid[None, :]
    excluded[torch.arange(b, device=ids.device), target] = False
    i2t = masked(scale * at_least_fp32(image_embeds) @ all_texts.t(), excluded)
    t2i = masked(scale * at_least_fp32(text_embeds) @ all_images.t(), excluded)
    per_row = F.cross_entropy(i2t, target, reduction="none") + F.cross_entropy(t2i, target, reduction="none")
    if rows_out is not None:
        rows_out.append(per_row.detach() / 2)
    return g.normalize((w * per_row).sum() / 2)


def siglip_loss(
    image_embeds: torch.Tensor,
    text_embeds: torch.Tensor,
    logit_scale: torch.Tensor,
    logit_bias: torch.Tensor | None,
    rows: Rows,
    rows_out: list | None = None,
) -> torch.Tensor:
    """Sigmoid loss: every (image, text) pair is a binary match / no-match decision.

    Each rank scores its images against all texts, so every global pair is counted once; a pair with
    the same sample id is a match. Normalized by the (weighted) number of valid images, as in SigLIP.
    """
    ids = rows.ids
    valid = rows.has_image & rows.has_text
    w = _row_weights(valid, rows.row_weights)
    g = GlobalBatch.build(ids, valid, w, text_embeds)
    all_texts = all_gather_with_grad(at_least_fp32(text_embeds), g.shapes[0])
    logits = scale_of(logit_scale) * at_least_fp32(image_embeds) @ all_texts.t()
    if logit_bias is not None:
        logits = logits + at_least_fp32(logit_bias)
    labels = (ids[:, None] == g.ids[None, :]).float() * 2 - 1
    pairs = g.valid[None, :].float()
    per_row = -(F.logsigmoid(labels * logits) * pairs).sum(dim=1)
    if rows_out is not None:
        rows_out.append(per_row.detach())
    return g.normalize((w * per_row).sum())


# ---------------------------------------------------------------------------------------------
# Image-text matching


def sample_negatives(
    sim: torch.Tensor,
    row_ids: torch.Tensor,
    col_ids: torch.Tensor,
    col_ok: torch.Tensor,
    uniform: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One hard negative column per row, drawn with probability softmax(sim) among the allowed columns.

    Allowed: ``col_ok`` ([n] for every row, or [b, n] per row) and a sample id different from the row's (never a positive, even when the
    same sample sits on another rank). The draw inverts each row's cumulative distribution at
    ``uniform`` ([b] in [0, 1); fresh ``torch.rand`` numbers when None), so a row keyed to the same
    number over the same columns picks the same negative (:mod:`vltrain.objectives.keyed`).
    Returns (column index [b], found [b] bool); a row with no allowed column gets an arbitrary index
    and found=False, so its pair must get zero weight. Everything stays on the device.
    """
    with torch.no_grad():
        ok = col_ok if col_ok.dim() == 2 else col_ok[None, :]
        allowed = ok & (row_ids[:, None] != col_ids[None, :])
        found = allowed.any(dim=1)
        s = at_least_fp32(sim).masked_fill(~allowed, float("-inf"))
        top = s.amax(dim=1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = (s - top).exp()
        p = torch.where(found[:, None], p, torch.ones_like(p))
        cdf = p.cumsum(dim=1)
        if uniform is None:
            uniform = torch.rand(sim.shape[0], device=sim.device)
        target = uniform.to(cdf.dtype)[:, None] * cdf[:, -1:]
        # the first column whose cumulative mass passes the target (never one of mass 0)
        index = (cdf <= target).sum(dim=1).clamp(max=sim.shape[1] - 1)
    return index, found


def _over(summed: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``summed / total``, or 0 where nothing counted (``total`` 0)."""
    return summed / torch.where(total > 0, total, torch.ones_like(total))


def itm_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, rows_out: list | None = None,
             denominator: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted mean cross-entropy of matched (1) / not matched (0) over the pairs with weight > 0.
    ``rows_out`` receives each pair's cross-entropy (detached). ``denominator`` replaces the local
    sum of weights (a global one: the step's over every rank and micro-batch)."""
    ce = F.cross_entropy(at_least_fp32(logits), labels, reduction="none")
    if rows_out is not None:
        rows_out.append(ce.detach())
    return _over((weights * ce).sum(), weights.sum() if denominator is None else denominator)


# ---------------------------------------------------------------------------------------------
# Masked language modelling


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    *,
    mask_id: int,
    vocab_size: int,
    pad_id: int,
    probability: float = 0.15,
    draws: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT masking: pick ``probability`` of the real tokens; of those 80% -> [MASK], 10% -> a random
    token, 10% unchanged. Returns (masked ids, labels with -100 where not picked).

    ``draws``: three float tensors in [0, 1) of the ids' shape (whether picked, how, which random
    token); keyed ones (:mod:`vltrain.objectives.keyed`) make the masks a function of the sample and
    the step. None: fresh ``torch.rand`` numbers."""
    if draws is None:
        draws = tuple(torch.rand(input_ids.shape, device=input_ids.device) for _ in range(3))
    draw, how, token = draws
    real = attention_mask.bool() & (input_ids != pad_id) & (input_ids != mask_id)
    random_tokens = (token * vocab_size).long().clamp(max=vocab_size - 1)
    picked = real & (draw < probability)
    labels = torch.where(picked, input_ids, torch.full_like(input_ids, -100))
    masked = torch.where(picked & (how < 0.8), torch.full_like(input_ids, mask_id), input_ids)
    masked = torch.where(picked & (how >= 0.8) & (how < 0.9), random_tokens, masked)
    return masked, labels


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
             rows_out: list | None = None, denominator: torch.Tensor | None = None,
             label_smoothing: float = 0.0) -> torch.Tensor:
    """Cross-entropy over picked tokens (labels other than -100), each weighted by its row's weight;
    zero when none is picked: MLM's masked tokens, captioning's next tokens.
    ``rows_out`` receives each row's mean over its picked tokens (detached; 0 where none).
    ``denominator`` replaces the local weighted count of picked tokens."""
    return token_mean(token_cross_entropy(logits, labels, label_smoothing), labels, weights, rows_out, denominator)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """[B * L] each token's cross-entropy of logits [B, L, V] (in at least fp32) against labels [B, L];
    0 where the label is -100."""
    return F.cross_entropy(at_least_fp32(logits).flatten(0, 1), labels.flatten(), ignore_index=-100,
                           reduction="none", label_smoothing=label_smoothing)


def token_mean(ce: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
               rows_out: list | None = None, denominator: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`mlm_loss` given each token's cross-entropy ``ce`` ([B * L], 0 where the label is -100)
    instead of the logits (e.g. :func:`vltrain.objectives.chunked.chunked_cross_entropy`'s)."""
    if rows_out is not None:
        picked = (labels != -100).float()
        rows_out.append((ce.detach().view_as(picked) * picked).sum(dim=1) / picked.sum(dim=1).clamp(min=1))
    w = (labels != -100).float()
    if weights is not None:
        w = w * weights.float()[:, None]
    w = w.flatten()
    return _over((w * ce).sum(), w.sum() if denominator is None else denominator)


# ---------------------------------------------------------------------------------------------
# Masked image modelling


MIM_BETA = 0.01
"""Half-width of the quadratic zone of MIM's smooth L1, in normalized pixel units (a pixel spans
about 4). L1 pulls predictions onto their targets, where its gradient (the error's sign) flips on a
rounding error; Adam then turns that one flipped term into a step of the learning rate's size, and
the same run split another way drifts apart (2.3e-5 in the parameters after 8 steps on an Intel
Xeon with AMX). Inside the zone the gradient is the error over beta: continuous, so a rounding
error moves it by a rounding error. SimMIM found L1 and smooth L1 to train equally well."""


def mim_loss(prediction: torch.Tensor, target: torch.Tensor, patch_mask: torch.Tensor,
             weights: torch.Tensor | None = None, rows_out: list | None = None,
             denominator: torch.Tensor | None = None) -> torch.Tensor:
    """SimMIM's regression of the masked patches' pixels ([B, patches, 3pp] each) by a smooth L1
    (``MIM_BETA``), a mean over masked patches weighted by their row's weight; zero when nothing is
    masked. ``rows_out`` receives each row's mean over its masked patches (detached).
    ``denominator`` replaces the local weighted count of masked patches."""
    per_patch = F.smooth_l1_loss(at_least_fp32(prediction), at_least_fp32(target), reduction="none", beta=MIM_BETA).mean(dim=-1)
    m = patch_mask.float()
    if rows_out is not None:
        rows_out.append((per_patch.detach() * m).sum(dim=1) / m.sum(dim=1).clamp(min=1))
    if weights is not None:
        m = m * weights.float()[:, None]
    return _over((m * per_patch).sum(), m.sum() if denominator is None else denominator)
