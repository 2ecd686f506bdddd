"""The passes that need only the model: what :class:`vltrain.compose.task.Task` runs for evaluation and
caption generation, each typed by what it computes.

They sit here, below ``train/``, so that evaluation and generation name them without importing the
task: whatever runs them (the wrapped task, whose ``forward`` FSDP2 gathers the parameters in, or
:func:`direct` on a bare model) calls ``run(model, objectives)``, and these read the model alone.
The passes that score objectives are the task's (:mod:`vltrain.compose.task`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from vltrain.types import Encoded, ModelInputs, Tokens


@dataclass(frozen=True)
class Encode:
    """The towers' outputs of ``inputs``, scored by nothing (evaluation, gradient caching's first pass)."""

    inputs: ModelInputs

    def run(self, model, objectives: Any = None) -> Encoded:
        return model.encode(self.inputs)


@dataclass(frozen=True)
class ImageTokens:
    """The vision tower's un-pooled tokens of ``images`` (an ``Images``), whether or not the model's
    heads read them (dense evaluation: a probe on the patch tokens of a dual encoder)."""

    images: Any

    def run(self, model, objectives: Any = None) -> Tokens:
        return model.image_tokens(self.images)


@dataclass(frozen=True)
class ItmLogits:
    """ITM logits [B, 2] of fused (text, image) pairs (evaluation's re-ranking)."""

    text_tokens: torch.Tensor
    attention_mask: torch.Tensor
    image_tokens: Tokens

    def run(self, model, objectives: Any = None) -> torch.Tensor:
        return model.itm_logits(self.text_tokens, self.attention_mask, self.image_tokens)


@dataclass(frozen=True)
class CaptionStart:
    """The next-token logits [B, V] after the prompt, and the cache that generation extends."""

    image_tokens: Tokens
    has_image: torch.Tensor
    prompt_ids: torch.Tensor

    def run(self, model, objectives: Any = None) -> tuple[torch.Tensor, Any]:
        return model.caption_start(self.image_tokens, self.has_image, self.prompt_ids)


@dataclass(frozen=True)
class CaptionStep:
    """The next-token logits [B, V] after the new positions ``ids``; ``cache`` grows by them."""

    ids: torch.Tensor
    cache: Any

    def run(self, model, objectives: Any = None) -> torch.Tensor:
        return model.caption_step(self.ids, self.cache)


@dataclass(frozen=True)
class CaptionNext:
    """The next-token logits [B, V] after ``ids``, every position recomputed (no cache)."""

    ids: torch.Tensor
    image_tokens: Tokens
    has_image: torch.Tensor

    def run(self, model, objectives: Any = None) -> torch.Tensor:
        return model.caption_next(self.ids, self.image_tokens, self.has_image)


def direct(model) -> Callable:
    """What runs a pass on a bare model (no task, no objectives)."""
    return lambda computation: computation.run(model)


@dataclass(frozen=True)
class LocCaLogits:
    """A LocCa decoder's logits [N, L, V] of its task rows (a :class:`vltrain.model.locca.TaskRows`)."""

    rows: Any
    image_tokens: Tokens
    has_image: torch.Tensor

    def run(self, model, objectives: Any = None) -> torch.Tensor:
        return model.locca_logits(self.rows, self.image_tokens, self.has_image)
