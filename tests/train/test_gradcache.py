"""Gradient caching gives the one-big-batch gradient; plain accumulation the mean of micro-batches'."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vltrain.images import Images
from vltrain.train.step import gradcache_backward, plain_backward
from vltrain.compose.task import Score, Task
from vltrain.types import ModelInputs


@dataclass
class Encoded:
    image_embeds: torch.Tensor
    text_embeds: torch.Tensor


@dataclass
class Output:
    loss: torch.Tensor
    losses: dict
    rows: dict


class StandIn(nn.Module):
    """The model contract in miniature: ``encode(inputs)``; it dropout-encodes when asked to."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.vision = nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 16), nn.Dropout(dropout), nn.Linear(16, 8))
        self.text = nn.Embedding(30, 8)
        self.text_proj = nn.Sequential(nn.Dropout(dropout), nn.Linear(8, 8))
        self.itm = nn.Linear(16, 2)
        self.logit_scale = nn.Parameter(torch.tensor(1.5))
        self.logit_bias = None

    def encode(self, inputs: ModelInputs) -> Encoded:
        mask = inputs.attention_mask.unsqueeze(-1).float()
        txt = (self.text(inputs.input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return Encoded(F.normalize(self.vision(inputs.images.pixels), dim=-1), F.normalize(self.text_proj(txt), dim=-1))


class StandInObjectives:
    """The objectives contract in miniature: an in-batch contrastive term plus a per-row ITM term."""

    def contrastive(self, image_embeds, text_embeds, rows, logit_scale, logit_bias=None, row_losses=None):
        logits = logit_scale.exp() * image_embeds @ text_embeds.T
        target = torch.arange(logits.shape[0])
        return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2

    def score(self, model, enc, inputs: ModelInputs, contrastive: bool = True) -> Output:
        pair = torch.cat([enc.image_embeds, enc.text_embeds], dim=-1)
        itm = F.cross_entropy(model.itm(pair), inputs.has_text.long())
        if not contrastive:
            return Output(itm, {"itm": itm}, {})
        itc = self.contrastive(enc.image_embeds, enc.text_embeds, inputs.rows(), model.logit_scale)
        return Output(itc + itm, {"itc": itc, "itm": itm}, {})


def stand_in(dropout: float = 0.0) -> Task:
    return Task(StandIn(dropout), StandInObjectives())


def make_inputs(n: int, seed: int = 0) -> ModelInputs:
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(n, 6, generator=g) > 0.3).long()
    mask[:, 0] = 1
    return ModelInputs(
        images=Images(torch.randn(n, 3, 4, 4, generator=g)), input_ids=torch.randint(0, 30, (n, 6), generator=g),
        attention_mask=mask, has_image=torch.ones(n, dtype=torch.bool),
        has_text=torch.rand(n, generator=g) > 0.2, ids=torch.arange(n),
    )


def split(m: ModelInputs, parts: int) -> list[ModelInputs]:
    size = m.ids.shape[0] // parts
    return [
        ModelInputs(*(getattr(m, f)[i * size : (i + 1) * size] for f in ("images", "input_ids", "attention_mask",
                      "has_image", "has_text", "ids")))
        for i in range(parts)
    ]


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def rel_err(a: dict, b: dict) -> float:
    num = sum(float((a[k] - b[k]).pow(2).sum()) for k in a) ** 0.5
    den = sum(float(b[k].pow(2).sum()) for k in b) ** 0.5
    return num / den


no_autocast = contextlib.nullcontext


def big_batch_grads(model: Task, inputs: ModelInputs) -> tuple[dict, torch.Tensor]:
    """The reference: contrastive loss over the whole batch + mean ITM, one backward."""
    model.zero_grad()
    out = model(Score(inputs))
    out.loss.backward()
    return grads(model), out.loss.detach()


@pytest.mark.parametrize("parts", [2, 4])
def test_gradcache_equals_one_big_batch(parts):
    torch.manual_seed(0)
    model = stand_in()
    inputs = make_inputs(16)
    ref, ref_loss = big_batch_grads(model, inputs)

    model.zero_grad()
    # equal-size micro-batches: the mean of their ITM losses is the big batch's mean
    res = gradcache_backward(model, split(inputs, parts), no_autocast, backward=lambda l: l.backward())
    assert rel_err(grads(model), ref) <= 1e-5
    assert model.model.logit_scale.grad is not None
    assert abs(res.loss.item() - ref_loss.item()) <= 1e-5


def test_gradcache_replays_dropout():
    """With one micro-batch and dropout on, both passes must draw the same masks: the gradient
    equals a plain forward/backward from the same RNG state."""
    model = stand_in(dropout=0.5)
    inputs = make_inputs(8)
    torch.manual_seed(123)
    ref, _ = big_batch_grads(model, inputs)
    after_ref = torch.rand(1)

    model.zero_grad()
    torch.manual_seed(123)
    gradcache_backward(model, [inputs], no_autocast, backward=lambda l: l.backward())
    assert rel_err(grads(model), ref) <= 1e-6
    assert torch.equal(torch.rand(1), after_ref)  # the RNG stream continues as after one pass


def test_plain_accumulation_is_mean_of_micro_batch_gradients():
    torch.manual_seed(0)
    model = stand_in()
    inputs = make_inputs(16)
    micro = split(inputs, 2)
    expected = None
    for m in micro:
        model.zero_grad()
        (model(Score(m)).loss / 2).backward()
        g = grads(model)
        expected = g if expected is None else {k: expected[k] + g[k] for k in g}

    model.zero_grad()
    res = plain_backward(model, micro, no_autocast, backward=lambda l: l.backward())
    assert rel_err(grads(model), expected) <= 1e-6
    assert set(res.losses) == {"itc", "itm"}


def test_nan_loss_scale_poisons_the_step():
    model = stand_in()
    res = plain_backward(model, [make_inputs(4)], no_autocast, backward=lambda l: l.backward(),
                         loss_scale=float("nan"))
    assert torch.isnan(res.loss)
