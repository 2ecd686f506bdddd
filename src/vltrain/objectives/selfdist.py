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

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from vltrain.images import Images
from vltrain.model.config import SelfDistSettings
from vltrain.objectives.keyed import UNKEYED, Stream
from vltrain.pixels import patchify
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import ModelInputs, ModelPasses, ModelSpec, RowLosses
from vltrain.views import UNIFORMS_PER_CROP, CropRange, patch_mask, views

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


# -- in a training step ---------------------------------------------------------------------------


@dataclass
class Views:
    """One micro-batch's views, drawn once a step from its rows with an image (:meth:`SelfDistillation.draw`),
    and, once the EMA teacher has seen the global views, its targets."""

    index: torch.Tensor
    """int64 [n] the micro-batch's rows the views are of."""
    present: int
    """How many of them have an image (0: ``index`` is one dummy row)."""
    weights: torch.Tensor
    """float [n] the rows' weights (one row of weight 0 where the micro-batch has no image: every
    rank runs the same passes)."""
    global_view: Images
    """[n, N, 3 * p * p] the global views, one to a row (padded layout, every patch real)."""
    local_views: Images
    """[n * V, M, 3 * p * p] the local views, row i's at rows i * V to i * V + V - 1."""
    mask: torch.Tensor
    """bool [n, N] the global view's patches the student sees as the mask token."""
    silc_targets: torch.Tensor | None = None
    """[n, K] the teacher's centred, sharpened distributions of the global views (with the step's centre)."""
    tips_targets: torch.Tensor | None = None
    """[n, N, K] the same of their patches."""


def _square(pixels: torch.Tensor, patch: int) -> Images:
    """Square views as one-to-a-row images at their own grid, which the tower's positions are resized to."""
    side = pixels.shape[-1] // patch
    grids = torch.full((pixels.shape[0], 2), side, dtype=torch.int64, device=pixels.device)
    return Images(patchify(pixels, patch), grids)


class SelfDistillation:
    """SILC and TIPS in a step (``model.loss.silc``, ``model.loss.tips``, ``model.selfdist``): the
    views (:meth:`draw`), the step's denominators (:meth:`totals`), the EMA teacher's targets and the
    centres' sums (:meth:`teach`, run with the teacher's weights in the model), and the student's
    losses (:meth:`score`)."""

    def __init__(self, weights: dict[str, float], settings: SelfDistSettings, spec: ModelSpec):
        self.on = [k for k in ("silc", "tips") if k in weights]
        self.settings, self.patch = settings, spec.patch_size
        size = int(math.isqrt(spec.num_patches)) * spec.patch_size
        local = settings.local_size or max(1, round(size * 3 / 7 / spec.patch_size)) * spec.patch_size
        self.global_crop = CropRange(size, tuple(settings.global_scale))
        self.local_crop = CropRange(local, tuple(settings.local_scale))

    @staticmethod
    def of(weights: dict[str, float], settings: SelfDistSettings, spec: ModelSpec) -> "SelfDistillation | None":
        """The two losses' part of a step where either is on (the model then has their heads)."""
        if "silc" not in weights and "tips" not in weights:
            return None
        if "selfdist" not in spec.heads:
            raise ValueError("model.loss.silc and tips need the model's prototype heads (model.selfdist.heads)")
        return SelfDistillation(weights, settings, spec)

    def draw(self, inputs: ModelInputs) -> Views:
        """The views of the micro-batch's present rows with an image, keyed by (seed, step, sample id):
        one global view at the model's image size, ``local_views`` local ones, and the global view's
        mask (exactly ``mask_ratio`` of its patches). One host synchronization: the rows' count."""
        index = inputs.has_image.nonzero().squeeze(1)
        n = index.numel()
        if not n:  # a dummy row of weight 0: every rank runs the same passes
            index = torch.zeros(1, dtype=torch.int64, device=inputs.ids.device)
        images = inputs.images.unpacked().index_select(0, index)
        ids = inputs.ids.index_select(0, index)
        w = torch.ones(len(ids), device=ids.device) if inputs.row_weights is None else inputs.row_weights[index].float()
        w = w if n else torch.zeros_like(w)
        key, v = inputs.key or UNKEYED, self.settings.local_views
        g = key.uniform(Stream.GLOBAL_VIEW, ids, UNIFORMS_PER_CROP).view(-1, 1, UNIFORMS_PER_CROP)
        local = key.uniform(Stream.LOCAL_VIEW, ids, v * UNIFORMS_PER_CROP).view(-1, v, UNIFORMS_PER_CROP)
        global_view = _square(views(images, g, self.global_crop, self.patch).pixels, self.patch)
        positions = global_view.pixels.shape[1]
        mask = patch_mask(key.uniform(Stream.VIEW_MASK, ids, positions), self.settings.mask_ratio)
        return Views(index, n, w, global_view, _square(views(images, local, self.local_crop, self.patch).pixels, self.patch), mask)

    def totals(self, drawn: Views) -> dict[str, torch.Tensor]:
        """This micro-batch's part of each loss's step denominator: weighted (row, local view) pairs,
        weighted masked patches."""
        found = {"silc": silc_denominator(drawn.weights, self.settings.local_views),
                 "tips": tips_denominator(drawn.mask, drawn.weights)}
        return {k: found[k] for k in self.on}

    @torch.no_grad()
    def teach(self, passes: ModelPasses, drawn: Views) -> tuple[Views, list[torch.Tensor]]:
        """The teacher's pass (the model holding the EMA's weights): its targets of the global views
        with the centres the step began with, and the centres' sums and counts over this micro-batch
        ([silc sums, silc count, tips sums, tips count]) for :func:`updated_centre`."""
        s = self.settings
        silc, tips = passes.selfdist_logits(drawn.global_view, None, "silc" in self.on, "tips" in self.on)
        silc_centre, tips_centre = passes.selfdist_centres()
        counted = drawn.weights > 0
        sums: list[torch.Tensor] = []
        for logits, centre, rows in ((silc, silc_centre, counted), (tips, tips_centre, counted[:, None].expand(
                drawn.mask.shape))):
            if logits is None:
                sums += [torch.zeros_like(centre, dtype=torch.float32), torch.zeros((), device=centre.device)]
                continue
            sums += list(centre_sums(logits, rows))
        drawn = replace(drawn, silc_targets=None if silc is None else teacher_targets(silc, silc_centre,
                                                                                     s.teacher_temperature),
                        tips_targets=None if tips is None else teacher_targets(tips, tips_centre, s.teacher_temperature))
        return drawn, sums

    def score(self, passes: ModelPasses, drawn: Views, totals: dict[str, torch.Tensor | None],
              rows: dict[str, RowLosses], batch: int) -> dict[str, torch.Tensor]:
        """The student's losses on the views (the step's ``totals`` their denominators): SILC of its
        local views against the teacher's global ones, TIPS of its masked global views' patches
        against the teacher's; each row's loss in ``rows`` (of a micro-batch of ``batch`` rows). A
        head whose loss is off stays in the graph at zero."""
        s, out = self.settings, {}
        found: dict[str, list] = {"silc": [], "tips": []}
        if "silc" in self.on:
            logits, _ = passes.selfdist_logits(drawn.local_views, None, True, False)
            out["silc"] = silc_loss(logits.view(len(drawn.weights), s.local_views, -1), drawn.silc_targets,
                                    s.student_temperature, drawn.weights, totals.get("silc"), found["silc"])
        if "tips" in self.on:
            _, logits = passes.selfdist_logits(drawn.global_view, drawn.mask, False, True)
            out["tips"] = tips_loss(logits, drawn.tips_targets, drawn.mask, s.student_temperature, drawn.weights,
                                    totals.get("tips"), found["tips"])
        if len(out) < 2:
            out[self.on[0]] = out[self.on[0]] + passes.selfdist_anchor()
        counted = (drawn.weights > 0).float()
        for name in out:
            values = torch.zeros(batch, device=counted.device).index_add(0, drawn.index, found[name][0] * counted)
            applies = torch.zeros(batch, device=counted.device).index_add(0, drawn.index, counted) > 0
            rows[name] = RowLosses(values, applies)
        return out
