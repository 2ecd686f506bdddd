"""The task: a model and its objectives, composed into the one module that DDP and FSDP2 wrap.

It lives in ``train/``, above both: the model encodes and offers its passes, the objectives score
tensors and import no model class, and this is the one place that holds the two together.

DDP prepares its gradient reduction in ``forward`` and FSDP2 gathers the root's parameters there,
so every pass that leads to a backward goes through ``Task.forward``, named by its part:

- ``task("all", inputs)``: encode and score every objective (plain accumulation, the demo);
- ``task("encode", inputs)``: the embeddings only (evaluation, gradient caching's first pass);
- ``task("contrastive", image_embeds, text_embeds, rows)``: the weighted ITC + SigLIP term on given
  embeddings, and its per-row losses (gradient caching's loss over the cached global batch);
- ``task("replay", inputs, cache, i, encode_rng)``: gradient caching's second pass
  over micro-batch ``i`` (see :mod:`vltrain.train.step`);
- ``task("itm", text_tokens, attention_mask, image_tokens)``: ITM logits [B, 2] of fused pairs
  (evaluation's re-ranking: under FSDP2 the fusion encoder and the head are gathered only here);
- ``task("caption_start" | "caption_step" | "caption_next", ...)``: caption
  generation's passes (:mod:`vltrain.model.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vltrain.model.model import VLModel
from vltrain.objectives.scoring import ObjectiveOutput, Objectives
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import ModelInputs, Rows, Tokens


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


class Task(nn.Module):
    """``model`` (encodes; holds every parameter) with ``objectives`` (score; hold none)."""

    def __init__(self, model: VLModel, objectives: Objectives):
        super().__init__()
        self.model = model
        self.objectives = objectives

    def forward(self, part: str, *args: Any) -> Any:
        if part == "all":
            return self.all(*args)
        if part == "encode":
            return self.model.encode(*args)
        if part == "contrastive":
            row_losses: dict = {}
            image_embeds, text_embeds, rows = args
            loss = self.objectives.contrastive(image_embeds, text_embeds, rows, self.model.logit_scale,
                                               self.model.logit_bias, row_losses)
            return loss, row_losses
        if part == "replay":
            return self.replay(*args)
        if part == "itm":
            return self.itm(*args)
        if part in self.GENERATION:
            return getattr(self.model, part)(*args)
        raise ValueError(f"unknown task part {part!r}")

    GENERATION = ("caption_start", "caption_step", "caption_next")
    """The captioning decoder's generation passes (``VLModel``'s methods of these names), through
    ``forward`` so that FSDP2 gathers the parameters they read."""

    def all(self, inputs: ModelInputs) -> ObjectiveOutput:
        return self.objectives.score(self.model, self.model.encode(inputs), inputs)

    def itm(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        return self.model.itm_logits(text_tokens, attention_mask, image_tokens)

    def replay(self, inputs: ModelInputs, cache: ContrastiveCache, i: int, encode_rng: GeneratorState
               ) -> tuple[torch.Tensor, ObjectiveOutput]:
        """Re-encode micro-batch ``i`` with the generator state of its first pass (so that any
        randomness in encoding repeats), then score its non-contrastive objectives, whose draws are
        keyed by the step and the samples (:mod:`vltrain.objectives.keyed`). Returns (contrastive
        term, other objectives)."""
        encode_rng.restore()
        enc = self.model.encode(inputs)
        contrastive = cache.term(self.objectives, self.model, enc.image_embeds, enc.text_embeds, i)
        return contrastive, self.objectives.score(self.model, enc, inputs, contrastive=False)
