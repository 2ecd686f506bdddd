"""The task: a model and its objectives, composed into the one module that DDP and FSDP2 wrap.

It lives in ``train/``, above both: the model encodes and offers its passes, the objectives score
tensors and import no model class, and this is the one place that holds the two together.

DDP prepares its gradient reduction in ``forward`` and FSDP2 gathers the root's parameters there,
so every pass that leads to a backward goes through ``Task.forward``. A pass is a value of the type
of what it computes (a :class:`Computation`: its inputs, and ``run`` on the model and the
objectives), so that ``task(Score(inputs))`` reads as what it returns:

- :class:`Score`: encode and score every objective (plain accumulation, the demo);
- :class:`Contrastive`: the weighted ITC + SigLIP term on given embeddings, and its per-row losses
  (gradient caching's loss over the cached global batch);
- :class:`Replay`: gradient caching's second pass over one micro-batch (see :mod:`vltrain.train.step`);
- the passes that read the model alone, in :mod:`vltrain.model.passes` so that evaluation and
  generation name them from below: ``Encode`` (the embeddings only: evaluation, gradient caching's
  first pass), ``ItmLogits`` (evaluation's re-ranking: under FSDP2 the fusion encoder and the head
  are gathered only here) and caption generation's ``CaptionStart``, ``CaptionStep`` and
  ``CaptionNext`` (:mod:`vltrain.model.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from vltrain.model.model import VLModel
from vltrain.objectives.scoring import ObjectiveOutput, Objectives
from vltrain.objectives.selfdist import Views
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import ModelInputs, Rows


class GeneratorState:
    """The default generators' state (the CPU's and, on CUDA, the device's), taken at creation.

    A plain object, not a tuple of tensors: DDP and FSDP2 move the tensors they find in
    ``forward``'s arguments to the device, and the CPU generator's state must stay on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)


@dataclass
class ContrastiveCache:
    """One step's embeddings, computed without autograd, and the contrastive loss's gradient with
    respect to them."""

    image_embeds: torch.Tensor
    """[N, D] fp32, the step's micro-batches in order."""
    text_embeds: torch.Tensor
    image_grad: torch.Tensor
    text_grad: torch.Tensor
    rows: Rows
    """The step's rows, concatenated."""
    bounds: list[int]
    """Micro-batch ``i`` holds rows ``bounds[i]:bounds[i + 1]``."""
    loss_scale: float

    def term(self, objectives: Objectives, model: VLModel, image_embeds, text_embeds, i: int) -> torch.Tensor:
        """Micro-batch ``i``'s contrastive term: the cached gradient dotted with its live embeddings
        (a surrogate with the exact gradient). The last micro-batch rebuilds the full loss from the
        cache with its live slice in place, so the temperature gets its gradient exactly once."""
        lo, hi = self.bounds[i], self.bounds[i + 1]
        img, txt = at_least_fp32(image_embeds), at_least_fp32(text_embeds)
        if i < len(self.bounds) - 2:
            return (img * self.image_grad[lo:hi]).sum() + (txt * self.text_grad[lo:hi]).sum()
        cached_img, cached_txt = self.image_embeds.detach(), self.text_embeds.detach()
        full_img = torch.cat([cached_img[:lo], img, cached_img[hi:]])
        full_txt = torch.cat([cached_txt[:lo], txt, cached_txt[hi:]])
        loss = objectives.contrastive(full_img, full_txt, self.rows, model.logit_scale, model.logit_bias)
        return at_least_fp32(loss) * self.loss_scale


T = TypeVar("T", covariant=True)


class Computation(Protocol[T]):
    """What a pass through :class:`Task` computes: given the model and the objectives, a ``T``."""

    def run(self, model: VLModel, objectives: Objectives) -> T: ...


class Task(nn.Module):
    """``model`` (encodes; holds every parameter) with ``objectives`` (score; hold none)."""

    def __init__(self, model: VLModel, objectives: Objectives):
        super().__init__()
        self.model = model
        self.objectives = objectives

    def forward(self, computation: Computation[T]) -> T:
        return computation.run(self.model, self.objectives)


@dataclass(frozen=True)
class Score:
    """Encode ``inputs`` and score every objective on them."""

    inputs: ModelInputs

    def run(self, model: VLModel, objectives: Objectives) -> ObjectiveOutput:
        return objectives.score(model, model.encode(self.inputs), self.inputs)


@dataclass(frozen=True)
class Contrastive:
    """The weighted ITC + SigLIP term on given embeddings, and its per-row losses."""

    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    rows: Rows

    def run(self, model: VLModel, objectives: Objectives) -> tuple[torch.Tensor, dict]:
        row_losses: dict = {}
        loss = objectives.contrastive(self.image_embeds, self.text_embeds, self.rows, model.logit_scale,
                                      model.logit_bias, row_losses)
        return loss, row_losses


@dataclass(frozen=True)
class Teach:
    """The EMA teacher's pass over one micro-batch's views (SILC, TIPS; the model holding the
    teacher's weights, without autograd): the views with the teacher's targets, and the centres' sums
    (:meth:`vltrain.objectives.selfdist.SelfDistillation.teach`)."""

    views: Views

    def run(self, model: VLModel, objectives: Objectives) -> tuple[Views, list[torch.Tensor]]:
        return objectives.selfdist.teach(model, self.views)


@dataclass(frozen=True)
class Replay:
    """Gradient caching's second pass over micro-batch ``i``: re-encode it with the generator state
    of its first pass (so that any randomness in encoding repeats), then score its non-contrastive
    objectives, whose draws are keyed by the step and the samples (:mod:`vltrain.objectives.keyed`).
    Returns (contrastive term, other objectives)."""

    inputs: ModelInputs
    cache: ContrastiveCache
    i: int
    encode_rng: GeneratorState

    def run(self, model: VLModel, objectives: Objectives) -> tuple[torch.Tensor, ObjectiveOutput]:
        self.encode_rng.restore()
        enc = model.encode(self.inputs)
        contrastive = self.cache.term(objectives, model, enc.image_embeds, enc.text_embeds, self.i)
        return contrastive, objectives.score(model, enc, self.inputs, contrastive=False)
