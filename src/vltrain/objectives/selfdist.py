"""SigLIP 2's self-distillation (SILC) and masked prediction (TIPS) losses, on prototype logits.

Parameter-free arithmetic on the logits of the prototype heads (:mod:`vltrain.model.selfdist`), the
student's and its EMA teacher's; what each means and what was chosen where SigLIP 2 is silent:
docs/objectives.md#self-distillation-silc-and-masked-prediction-tips. DINO's recipe
(facebookresearch/dino, ``DINOLoss``), iBOT's for the patches:

- the teacher's logits ``t`` become targets ``softmax((t - centre) / T_t)`` (:func:`teacher_targets`),
  with no gradient;
- the student's logits ``s`` are scored by the cross-entropy ``-sum_k target_k log softmax(s / T_s)_k``;
- SILC (:func:`silc_loss`) scores each of a row's local views against the row's global-view target,
  TIPS (:func:`tips_loss`) each masked patch against the teacher's patch at that position;
- the centre follows the teacher's mean logit over the global batch (:func:`centre_sums`,
  :func:`updated_centre`).

Nothing here depends on how a step is split among ranks and micro-batches
(docs/distributed.md#the-global-batch), provided the caller keeps two contracts:

- **the losses' denominators are the step's.** Each loss is a weighted mean, ``sum(w * ce) /
  denominator``; the caller sums :func:`silc_denominator` and :func:`tips_denominator` over its
  micro-batches and all-reduces them over the ranks before the step's first backward (as
  ``Objectives.local_totals`` does for ITM, MLM and MIM), then hands the total to every micro-batch.
  Without one, the local count is used: a mean over that micro-batch only.
- **the centre moves once a step, on the global batch.** Every micro-batch's targets use the centre
  as the step began; the caller adds :func:`centre_sums`' sums and counts over its micro-batches,
  all-reduces both (a sum) over the ranks, and then calls :func:`updated_centre` once, on every rank
  alike: the new centre is the same on any split of the same global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vltrain.runtime.precision import at_least_fp32

STUDENT_TEMPERATURE = 0.1
"""The student's softmax temperature (DINO's, and SILC's)."""

TEACHER_TEMPERATURE = 0.04
"""The teacher's: lower than the student's, which sharpens its targets (DINO's start value; it warms
up to 0.07 there, a schedule left to the caller)."""

CENTRE_MOMENTUM = 0.9
"""How much of the old centre a step keeps (DINO's ``center_momentum``)."""


def teacher_targets(teacher_logits: torch.Tensor, centre: torch.Tensor,
                    temperature: float = TEACHER_TEMPERATURE) -> torch.Tensor:
    """[..., K] the teacher's centred, sharpened distributions ``softmax((t - centre) / temperature)``
    of its logits [..., K], in at least fp32 and without a gradient. ``centre`` [K] is the one the
    step began with."""
    with torch.no_grad():
        return torch.softmax((at_least_fp32(teacher_logits) - centre) / temperature, dim=-1)


def _cross_entropy(student_logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[...] ``-sum_k target_k log softmax(s / temperature)_k`` over the last dimension; the targets
    are constants (detached)."""
    log_p = F.log_softmax(at_least_fp32(student_logits) / temperature, dim=-1)
    return -(targets.detach() * log_p).sum(dim=-1)


def _mean(summed: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``summed / total``, or 0 where nothing counted (``total`` 0)."""
    return summed / torch.where(total > 0, total, torch.ones_like(total))


def soft_cross_entropy(student_logits: torch.Tensor, targets: torch.Tensor,
                       temperature: float = STUDENT_TEMPERATURE, weights: torch.Tensor | None = None,
                       denominator: torch.Tensor | None = None) -> torch.Tensor:
    """The weighted mean over rows of the cross-entropy of the student's logits [M, K] against
    target distributions [M, K]: ``sum_i w_i ce_i / denominator``, the denominator by default the
    local ``sum_i w_i`` (``weights`` [M], by default ones). The pairing is the caller's: rows of
    masked patches already picked out, say."""
    ce = _cross_entropy(student_logits, targets, temperature)
    w = torch.ones_like(ce) if weights is None else weights.to(ce.dtype)
    return _mean((w * ce).sum(), w.sum() if denominator is None else denominator)


def silc_denominator(weights: torch.Tensor, views: int) -> torch.Tensor:
    """SILC's local count: each row's weight [B] (0 for a row without an image) times its ``views``
    local views."""
    return at_least_fp32(weights).sum() * views


def silc_loss(student_local: torch.Tensor, targets: torch.Tensor, temperature: float = STUDENT_TEMPERATURE,
              weights: torch.Tensor | None = None, denominator: torch.Tensor | None = None,
              rows_out: list | None = None) -> torch.Tensor:
    """SILC: the student's logits of each row's local views [B, V, K] against the teacher's target of
    the row's global view [B, K], every view of a row against its target (the two never share a
    view, so DINO's exclusion of same-view pairs excludes none). A mean over the (row, view) pairs
    weighted by their row's weight ([B], by default ones); ``denominator`` replaces the local
    :func:`silc_denominator`. ``rows_out`` receives each row's mean over its views (detached)."""
    ce = _cross_entropy(student_local, targets[:, None, :], temperature)
    if rows_out is not None:
        rows_out.append(ce.detach().mean(dim=1))
    w = torch.ones(ce.shape[0], dtype=ce.dtype, device=ce.device) if weights is None else weights.to(ce.dtype)
    total = silc_denominator(w, ce.shape[1]) if denominator is None else denominator
    return _mean((w[:, None] * ce).sum(), total)


def tips_denominator(mask: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """TIPS's local count: the masked patches [B, N] (bool), each weighted by its row's weight [B]."""
    m = mask.float()
    return (m if weights is None else m * at_least_fp32(weights)[:, None]).sum()


def tips_loss(student_patch_logits: torch.Tensor, teacher_patch_targets: torch.Tensor, mask: torch.Tensor,
              temperature: float = STUDENT_TEMPERATURE, weights: torch.Tensor | None = None,
              denominator: torch.Tensor | None = None, rows_out: list | None = None) -> torch.Tensor:
    """TIPS: at each masked position (``mask`` [B, N], True where the student saw a mask token), the
    student's patch logits [B, N, K] against the teacher's patch target there [B, N, K] (the teacher
    saw the whole image). A mean over the masked patches weighted by their row's weight ([B], by
    default ones); unmasked positions count for nothing, in value or gradient. ``denominator``
    replaces the local :func:`tips_denominator`. ``rows_out`` receives each row's mean over its
    masked patches (detached; 0 where none)."""
    ce = _cross_entropy(student_patch_logits, teacher_patch_targets, temperature)
    m = mask.to(ce.dtype)
    ce = torch.where(mask, ce, torch.zeros_like(ce))
    if rows_out is not None:
        rows_out.append(ce.detach().sum(dim=1) / m.sum(dim=1).clamp(min=1))
    w = m if weights is None else m * weights.to(ce.dtype)[:, None]
    return _mean((w * ce).sum(), w.sum() if denominator is None else denominator)


def centre_sums(teacher_logits: torch.Tensor, counted: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of the teacher's logits [..., K] over every leading position that ``counted`` [...]
    (bool; by default all) keeps, and how many it kept: ([K], []), in at least fp32, detached. What the
    caller adds over micro-batches and all-reduces over ranks before :func:`updated_centre` (the
    module's docstring says why). For SILC the positions are rows with an image; for TIPS, the real
    patches of those rows (all of them, not only the masked ones: the teacher saw them all)."""
    t = at_least_fp32(teacher_logits).detach().flatten(0, -2)
    if counted is None:
        return t.sum(dim=0), t.new_tensor(float(t.shape[0]))
    keep = counted.flatten().to(t.dtype)
    return (t * keep[:, None]).sum(dim=0), keep.sum()


def updated_centre(centre: torch.Tensor, sums: torch.Tensor, count: torch.Tensor,
                   momentum: float = CENTRE_MOMENTUM) -> torch.Tensor:
    """The next centre, ``momentum * centre + (1 - momentum) * sums / count``, given the global
    batch's :func:`centre_sums` (summed over micro-batches and ranks); the centre as it was when the
    step counted nothing. Returned in the centre's dtype, for the caller to copy into the teacher
    head's buffer (``head.centre.copy_(...)``)."""
    mean = sums / torch.where(count > 0, count, torch.ones_like(count))
    moved = momentum * at_least_fp32(centre) + (1 - momentum) * mean
    return torch.where(count > 0, moved, at_least_fp32(centre)).to(centre.dtype)
