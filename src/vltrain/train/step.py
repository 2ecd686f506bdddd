"""One optimizer step, in one place: what :meth:`Step.__call__` does, in order.

1. **The teacher's pass** (distillation with a teacher that runs, :class:`vltrain.train.teacher.Teacher`):
   each micro-batch embedded by the teacher on its own view of the rows, without autograd.
2. **Key the micro-batches** (:meth:`Step.keyed`): the step's key, the patches each image keeps
   under patch dropout, each micro-batch's masks (and SILC's and TIPS's views) drawn once, and the
   averaged objectives' denominators (those masks counted) summed over every rank.
   **The EMA teacher's pass** (SILC, TIPS: :meth:`Step.taught`): the model holding the average's
   weights gives the views their targets, then the teacher's centres move on the global batch.
3. **Forward and backward** over the micro-batches: plain accumulation (:func:`plain_backward`), each
   micro-batch's contrastive loss seeing only itself, or exact contrastive accumulation
   (:func:`gradcache_backward`). Both leave the gradient of the whole step in ``.grad``, reduced
   across ranks by the last backward, and return the step's losses averaged the way they were
   optimised.
4. **The gradient**: replicated gradients reduced, unscaled, clipped.
5. **One all-reduce of one packet** (:class:`Agreed`): whether some rank's loss or gradient norm is
   not finite, the samples, the losses; read by name.
6. **The update or its skip** (:func:`apply_update`), the scaler, the schedule (a skipped step still
   consumed its data: the schedule follows the step count).
7. **The weight EMA** (``train.ema``, :class:`vltrain.train.ema.WeightAverage`), when the step is
   due: the average takes the weights as the update (or its skip) left them.

The trainer builds the parts (the teacher, the EMA, the objectives that draw the kept patches) and
hands them to the step; only the step calls them, in this order (``docs/architecture.md``, "One step").

Nothing here waits for the device (``tests/train/test_host_sync.py``): the skip is decided on the
device, and the trainer reads what the host needs of it when it settles.

Gradient caching. A contrastive loss couples every pair of the global batch, so accumulating
per-micro-batch losses optimises a different (weaker, fewer negatives) objective. Caching computes
the real gradient while keeping only one micro-batch's activations:

a. embed every micro-batch without autograd, keep the embeddings (small);
b. compute the contrastive loss over all cached embeddings, gathered across ranks, and take its
   gradient with respect to the embeddings only;
c. re-run each micro-batch with autograd and back-propagate ``sum(embedding * cached grad)`` plus
   its non-contrastive objectives (ITM, MLM); the last micro-batch rebuilds the full loss instead
   (:meth:`vltrain.compose.task.ContrastiveCache.term`).

Each micro-batch's RNG state is recorded before its encoding in (a) and restored before its encoding
in (c), so any randomness in encoding repeats in both passes. The non-contrastive objectives (ITM
negatives, MLM masks) run only in (c); their draws are keyed by the step and the sample ids, so they
do not depend on the generators at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager

import torch
from torch import nn

from vltrain.config.job import TrainConfig
from vltrain.model.passes import Encode
from vltrain.objectives.keyed import StepKey
from vltrain.objectives.scoring import Objectives
from vltrain.runtime.distributed import World, all_reduce_sum
from vltrain.runtime.faults import maybe_overflow
from vltrain.runtime.precision import Precision, at_least_fp32
from vltrain.train.ema import WeightAverage
from vltrain.objectives.selfdist import updated_centre
from vltrain.train.parallelize import clip_grad_norm, gradient_sync, reduce_replicated_grads, task_of
from vltrain.compose.task import Contrastive, ContrastiveCache, GeneratorState, Replay, Score, Teach
from vltrain.types import ModelInputs, Rows


@dataclass
class StepLosses:
    loss: torch.Tensor
    """The optimised total, detached; a 0-dim float tensor on the device."""
    losses: dict[str, torch.Tensor]
    rows: list[tuple[torch.Tensor | None, dict]] = field(default_factory=list)
    """Per micro-batch (or, for gradcache's contrastive term, per step): each row's source and each
    objective's per-row losses (``vltrain.objectives.scoring.RowLosses``), for per-source metrics."""

    def add(self, new: dict[str, torch.Tensor], scale: float) -> None:
        """Accumulate ``scale`` times each of ``new`` (detached, fp32) into ``losses``."""
        for k, v in new.items():
            v = at_least_fp32(v.detach()) * scale
            self.losses[k] = self.losses[k] + v if k in self.losses else v


@dataclass
class Agreed:
    """What every rank knows of a step after one all-reduce of one packet (0-dim, on the device)."""

    skip: torch.Tensor
    """bool: some rank's loss (or, without a gradient scaler, gradient norm) is not finite."""
    samples: torch.Tensor
    """The step's rows, over every rank."""
    loss: torch.Tensor
    """The optimised total, the ranks' mean."""
    losses: dict[str, torch.Tensor]
    """Each objective's loss, the ranks' mean."""

    @staticmethod
    def reduce(nonfinite: torch.Tensor, samples: torch.Tensor, result: StepLosses, world_size: int) -> "Agreed":
        """The packet ``[nonfinite, samples, loss, *losses by name]`` summed over the ranks, the
        losses then divided by the world size: the one place that knows its layout."""
        names = sorted(result.losses)
        packet = torch.cat([nonfinite.float().reshape(1), samples, at_least_fp32(result.loss).reshape(1),
                            *[at_least_fp32(result.losses[k]).reshape(1) for k in names]])
        if world_size > 1:
            packet = all_reduce_sum(packet)
            packet[2:] /= world_size
        return Agreed(skip=packet[0] > 0, samples=packet[1], loss=packet[2],
                      losses={k: packet[3 + i] for i, k in enumerate(names)})


@dataclass
class StepResult:
    """A step as the loop logs and counts it; tensors stay on the device until a log step."""

    agreed: Agreed
    grad_norm: torch.Tensor
    lr: float
    """The rate this step used (logged), not the next one's."""
    rows: list[tuple[torch.Tensor | None, dict]]
    """This rank's per-row losses (:attr:`StepLosses.rows`)."""


class Step:
    """One optimizer step over a step's micro-batches, given the parts it updates and calls.

    ``train`` is read at each step (``debug_nan_step`` and the like), not copied."""

    def __init__(self, wrapped: nn.Module, objectives: Objectives, params: list[torch.Tensor],
                 optimizer: torch.optim.Optimizer, scheduler, scaler: torch.amp.GradScaler,
                 precision: Precision, train: TrainConfig, world: World, teacher=None,
                 ema: WeightAverage | None = None):
        """``teacher``: a :class:`vltrain.train.teacher.Teacher` that embeds each micro-batch (None: no
        teacher runs; stored teacher embeddings come with the micro-batches). ``ema``: the weight
        average it updates after each due step (None: no ``train.ema``)."""
        self.wrapped, self.objectives, self.params = wrapped, objectives, params
        self.teacher, self.ema = teacher, ema
        self.optimizer, self.scheduler, self.scaler = optimizer, scheduler, scaler
        self.precision, self.train = precision, train
        self.world_size, self.rank = world.world_size, world.rank

    def __call__(self, micro: list[ModelInputs], step: int) -> StepResult:
        """Step ``step`` (0-based: the steps done before it) over this rank's micro-batches, its parts
        in the order of the module docstring."""
        tc = self.train
        if self.teacher is not None:
            micro = [replace(m, teacher=self.teacher.embed(m)) for m in micro]
        inputs = self.keyed(micro, step)
        if self.objectives.selfdist is not None:
            inputs = self.taught(inputs)
        poison = step == tc.debug_nan_step and tc.debug_nan_rank in (-1, self.rank)
        backward_fn = gradcache_backward if tc.contrastive_accumulation == "gradcache" else plain_backward
        self.optimizer.zero_grad(set_to_none=True)
        result = backward_fn(
            self.wrapped, inputs, self.precision.autocast,
            backward=lambda loss: self.scaler.scale(loss).backward(),
            loss_scale=math.nan if poison else 1.0,
        )
        reduce_replicated_grads(self.wrapped)
        maybe_overflow(self.params, step + 1, self.rank)
        # fp16's scaler: under FSDP2 each rank unscales its own shards, and DTensor's dispatch of the
        # unscale takes the max of found_inf over the mesh, so every rank skips the same steps
        # (tests/train/test_fp16_scaler.py)
        self.scaler.unscale_(self.optimizer)
        grad_norm = clip_grad_norm(self.params, tc.grad_clip)

        nonfinite = ~torch.isfinite(result.loss)
        if not self.scaler.is_enabled():
            nonfinite = nonfinite | ~torch.isfinite(grad_norm)
        samples = torch.tensor([float(sum(len(m) for m in micro))]).to(micro[0].ids.device, non_blocking=True)
        agreed = Agreed.reduce(nonfinite, samples, result, self.world_size)
        apply_update(self.optimizer, self.scaler, agreed.skip)
        self.scaler.update()
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        if self.ema is not None:
            self.ema.after_step(step + 1)
        return StepResult(agreed, grad_norm, lr, result.rows)

    def taught(self, inputs: list[ModelInputs]) -> list[ModelInputs]:
        """The EMA teacher's pass (SILC, TIPS): the model holding the average's weights, without
        autograd, gives each micro-batch's views their targets (with the centres the step began with);
        then the centres move once, on the global batch's sums (one all-reduce), the same on every rank."""
        taught, sums = [], None
        with self.ema.applied(), torch.no_grad(), self.precision.autocast():
            for m in inputs:
                views, part = self.wrapped(Teach(m.masks.views))
                taught.append(replace(m, masks=replace(m.masks, views=views)))
                sums = part if sums is None else [a + b for a, b in zip(sums, part)]
            if hasattr(self.wrapped, "reshard"):  # FSDP2: the next pass gathers the trained weights again
                self.wrapped.reshard()
        packet = torch.cat([t.reshape(-1) for t in sums])
        if self.world_size > 1:
            packet = all_reduce_sum(packet)
        k, settings = sums[0].numel(), self.objectives.selfdist.settings
        for centre, (at, count) in zip(task_of(self.wrapped).model.selfdist_centres(), ((0, k), (k + 1, 2 * k + 1))):
            centre.copy_(updated_centre(centre, packet[at:at + k], packet[count], settings.centre_momentum))
        return taught

    def keyed(self, micro: list[ModelInputs], step: int) -> list[ModelInputs]:
        """The step's key on each micro-batch: the draws keyed by (seed, step, sample), the patches
        each image keeps, its masks drawn once, and the averaged objectives' denominators (those masks
        counted) summed over every rank and micro-batch (one small all-reduce), shared out so that the
        ranks' mean of the micro-batches' mean is the global mean."""
        key = StepKey(self.train.seed, step)
        inputs = [replace(m, key=key) for m in micro]
        inputs = [replace(m, images=m.images.kept(self.objectives.patch_keep(m))) for m in inputs]
        names = self.objectives.averaged
        if not names:
            return inputs
        inputs = [replace(m, masks=self.objectives.draw(m)) for m in inputs]
        totals = self.objectives.local_totals(inputs)
        if self.world_size > 1:
            totals = all_reduce_sum(totals)
        share = totals / (self.world_size * len(inputs))
        key = StepKey(key.seed, key.step, {name: share[i] for i, name in enumerate(names)})
        return [replace(m, key=key) for m in inputs]


def plain_backward(
    wrapped: nn.Module,
    micro: list[ModelInputs],
    autocast: Callable[[], ContextManager],
    backward: Callable[[torch.Tensor], None],
    loss_scale: float = 1.0,
) -> StepLosses:
    """Mean of the micro-batches' losses; each micro-batch's contrastive loss sees only itself.

    ``wrapped`` is the (parallelized) :class:`vltrain.compose.task.Task`. ``loss_scale`` multiplies the loss
    before backward (e.g. a fault-injection NaN).
    """
    n = len(micro)
    result = StepLosses(torch.zeros((), device=micro[0].images.pixels.device), {})
    for i, m in enumerate(micro):
        with gradient_sync(wrapped, i == n - 1):
            with autocast():
                out = wrapped(Score(m))
            loss = at_least_fp32(out.loss) * loss_scale / n
            backward(loss)
        result.loss = result.loss + loss.detach()  # an fp64 run widens the fp32 zero
        result.add(out.losses, 1.0 / n)
        result.rows.append((m.source, out.rows))
    return result


def _cache(wrapped: nn.Module, micro: list[ModelInputs], autocast, loss_scale: float
           ) -> tuple[ContrastiveCache, torch.Tensor, dict, list[GeneratorState]]:
    """Gradient caching's (a) and (b): the cache, the contrastive loss and its per-row losses, and
    each micro-batch's RNG state before its encoding."""
    device = micro[0].images.pixels.device
    states, img_cache, txt_cache = [], [], []
    with torch.no_grad():
        for m in micro:
            states.append(GeneratorState(device))
            with autocast():
                enc = wrapped(Encode(m))
            img_cache.append(at_least_fp32(enc.image_embeds))
            txt_cache.append(at_least_fp32(enc.text_embeds))

    img_all = torch.cat(img_cache).requires_grad_(True)
    txt_all = torch.cat(txt_cache).requires_grad_(True)
    rows = Rows.cat([m.rows() for m in micro])
    # gradients to the embeddings only; no parameter gradient is touched or reduced here
    with gradient_sync(wrapped, False):
        with autocast():
            closs, row_losses = wrapped(Contrastive(img_all, txt_all, rows))
        g_img, g_txt = torch.autograd.grad(at_least_fp32(closs) * loss_scale, [img_all, txt_all])
    bounds = [0]
    for m in micro:
        bounds.append(bounds[-1] + len(m))
    cache = ContrastiveCache(img_all, txt_all, g_img, g_txt, rows, bounds, loss_scale)
    return cache, closs, row_losses, states


def gradcache_backward(
    wrapped: nn.Module,
    micro: list[ModelInputs],
    autocast: Callable[[], ContextManager],
    backward: Callable[[torch.Tensor], None],
    loss_scale: float = 1.0,
) -> StepLosses:
    """Leave in ``.grad`` the gradient of (contrastive loss over the global batch + mean of the
    micro-batches' other objectives); return those losses. Gradient caching's (c) after :func:`_cache`."""
    n = len(micro)
    cache, closs, row_losses, states = _cache(wrapped, micro, autocast, loss_scale)
    result = StepLosses(at_least_fp32(closs.detach()) * loss_scale, {"contrastive": at_least_fp32(closs.detach())})
    result.rows.append((cache.rows.source, row_losses))
    for i, m in enumerate(micro):
        with gradient_sync(wrapped, i == n - 1):
            with autocast():
                contrastive, other = wrapped(Replay(m, cache, i, states[i]))
            other_loss = at_least_fp32(other.loss) * loss_scale / n
            backward(contrastive + other_loss)
        result.loss = result.loss + other_loss.detach()
        result.add(other.losses, 1.0 / n)
        result.rows.append((m.source, other.rows))
    return result


def apply_update(optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: torch.Tensor) -> None:
    """Apply the optimizer step unless ``skip`` (a 0-dim bool on the device that every rank agreed).

    A fused optimizer skips on the device, through the ``found_inf`` it reads as a gradient
    scaler's verdict: the parameters, both moments and the step count stay as they were, and
    the host never waits to learn which. With fp16's gradient scaler (whose step reads its own
    verdict on the host) or an unfused optimizer, the verdict is read here.
    """
    if not scaler.is_enabled() and optimizer.defaults.get("fused"):
        optimizer.found_inf = skip.to(torch.float32)  # type: ignore[attr-defined]
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf  # type: ignore[attr-defined]
        return
    if bool(skip):
        optimizer.zero_grad(set_to_none=True)
    else:
        scaler.step(optimizer)
