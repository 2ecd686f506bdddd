"""Caption generation: greedy, beam search and nucleus (top-p) sampling over a captioning model's
decoder, batched, with cached keys and values.

The search calls the model through ``run(part, *args)``: the wrapped task (``Task.forward``, so that
FSDP2 gathers the parameters) or :func:`direct` for a bare model. Each call is one of
``VLModel.caption_start`` (the prompt, the image's cross-attention keys and values computed once),
``caption_step`` (one new position on the cache) or, with ``cache=False``, ``caption_next`` (every
position recomputed: what the cache is measured against).

Deterministic: greedy and beam search break ties towards the lower token id (stable sorts), and
top-p draws each image's numbers from a generator seeded by ``seed`` and the image's index in its
list, so an image gets the same caption whichever batch, rank or world size it falls in (to the
rounding of batched matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vltrain.errors import UserError
from vltrain.types import Tokens


@dataclass(frozen=True)
class Decoding:
    """How to generate: ``max_length`` tokens at most (the start token and the prompt included),
    greedy, ``beam`` > 1 beams, or nucleus sampling with ``top_p`` in (0, 1]."""

    max_length: int
    beam: int = 1
    top_p: float = 0.0
    seed: int = 0
    cache: bool = True
    length_penalty: float = 1.0
    """Beam search ranks its finished beams by total log-probability / generated tokens ** this."""

    def check(self, prompt_length: int, context: int) -> None:
        """One line for a setting that cannot work, naming it."""
        if self.beam < 1:
            raise UserError(f"--beam must be >= 1 (1: greedy), got {self.beam}")
        if self.top_p and self.beam > 1:
            raise UserError("--top-p samples one caption per image; it does not combine with --beam")
        if not 0 <= self.top_p <= 1:
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_length > context:
            raise UserError(f"--max-length {self.max_length} exceeds the model's text context of {context} tokens")
        if prompt_length >= context:
            raise UserError(f"the prompt takes {prompt_length} tokens with the start token, and the model's text "
                            f"context is {context}: shorten the prompt")
        if prompt_length >= self.max_length:
            raise UserError(f"the prompt takes {prompt_length} tokens with the start token, which leaves none of "
                            f"--max-length {self.max_length} to generate: raise --max-length (up to {context})")


def direct(model) -> Callable:
    """``run`` for a bare model: its method of the part's name."""
    return lambda part, *args: getattr(model, part)(*args)


def _local_all(done: torch.Tensor) -> bool:
    return bool(done.all())


def generate(run: Callable, image_tokens: Tokens, prompt: list[int], end_id: int, pad_id: int, decoding: Decoding,
             index: torch.Tensor | None = None, all_done: Callable[[torch.Tensor], bool] = _local_all
             ) -> list[list[int]]:
    """Each image's token ids: ``prompt`` (its start token first), then the generated ones up to
    and including ``end_id``. ``index`` [B]: the images' places in their list (top-p's seeds);
    ``all_done``: whether every row is finished, agreed over ranks when the passes hold collectives
    (FSDP2: every rank must make as many calls)."""
    b = len(image_tokens)
    device = image_tokens.values.device
    ids = torch.tensor(prompt, dtype=torch.long, device=device)[None].expand(b, -1)
    if index is None:
        index = torch.arange(b)
    with torch.no_grad():
        if decoding.beam > 1:
            out = _beam(run, image_tokens, ids, end_id, pad_id, decoding, all_done)
        else:
            out = _sample(run, image_tokens, ids, end_id, pad_id, decoding, index, all_done)
    return [_trim(row, end_id, pad_id, len(prompt)) for row in out.tolist()]


def _trim(row: list[int], end_id: int, pad_id: int, prompt_length: int) -> list[int]:
    """The row up to and including its first end token past the prompt; padding dropped."""
    for i in range(prompt_length, len(row)):
        if row[i] == end_id:
            return row[: i + 1]
    return [t for t in row if t != pad_id] if pad_id != end_id else row


class _Stepper:
    """The calls of one generation: cached (start, then one position at a time) or recomputed."""

    def __init__(self, run: Callable, image_tokens: Tokens, has_image: torch.Tensor, cache: bool):
        self.run, self.image_tokens, self.has_image, self.cached = run, image_tokens, has_image, cache
        self.cache = None

    def first(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cached:
            logits, self.cache = self.run("caption_start", self.image_tokens, self.has_image, ids)
            return logits
        return self.run("caption_next", ids, self.image_tokens, self.has_image)

    def next(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cached:
            return self.run("caption_step", ids[:, -1:], self.cache)
        return self.run("caption_next", ids, self.image_tokens, self.has_image)

    def keep(self, rows: torch.Tensor) -> None:
        """Only ``rows`` go on, in that order (beam search)."""
        if self.cached:
            self.cache = self.cache.select(rows)


def _sample(run: Callable, image_tokens: Tokens, ids: torch.Tensor, end_id: int, pad_id: int, decoding: Decoding,
            index: torch.Tensor, all_done: Callable) -> torch.Tensor:
    """Greedy (``top_p`` 0) or nucleus sampling, one token per image per position."""
    b, device = ids.shape[0], ids.device
    steps = decoding.max_length - ids.shape[1]
    draws = None
    if decoding.top_p:
        draws = torch.stack([torch.rand(steps, generator=torch.Generator().manual_seed(decoding.seed * 1_000_003 + int(i)))
                             for i in index.tolist()]).to(device)
    stepper = _Stepper(run, image_tokens, torch.ones(b, dtype=torch.bool, device=device), decoding.cache)
    logits = stepper.first(ids)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    for t in range(steps):
        token = logits.float().argmax(dim=-1) if draws is None else nucleus(logits, decoding.top_p, draws[:, t])
        token = torch.where(done, torch.full_like(token, pad_id), token)
        ids = torch.cat([ids, token[:, None]], dim=1)
        done = done | (token == end_id)
        if t == steps - 1 or all_done(done):
            break
        logits = stepper.next(ids)
    return ids


def nucleus(logits: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """A token per row drawn from the smallest set of most likely tokens whose probability reaches
    ``top_p`` (Holtzman et al., 2020), by inverse transform of ``u`` [B] (uniform in [0, 1))."""
    probs = logits.float().softmax(dim=-1)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    kept = torch.where(before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    kept[:, 0] = sorted_probs[:, 0]  # the most likely token is always in
    cdf = kept.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None].contiguous(), right=True).clamp(max=cdf.shape[1] - 1)
    return order.gather(1, pick)[:, 0]


def _beam(run: Callable, image_tokens: Tokens, ids: torch.Tensor, end_id: int, pad_id: int, decoding: Decoding,
          all_done: Callable) -> torch.Tensor:
    """Beam search: ``beam`` sequences per image, extended by the best ``beam`` of every beam's
    continuations; a finished beam stays, continued by padding at no cost. The best beam by
    log-probability / generated length ** ``length_penalty`` is returned."""
    b, k, prompt = ids.shape[0], decoding.beam, ids.shape[1]
    device = ids.device
    rows = torch.arange(b, device=device).repeat_interleave(k)
    stepper = _Stepper(run, image_tokens.index_select(rows), torch.ones(b * k, dtype=torch.bool, device=device),
                       decoding.cache)
    ids = ids.index_select(0, rows)
    logits = stepper.first(ids)
    scores = torch.full((b, k), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the beams start equal: only the first one is extended at first
    finished = torch.zeros(b * k, dtype=torch.bool, device=device)
    steps = decoding.max_length - prompt
    for t in range(steps):
        logp = logits.float().log_softmax(dim=-1)
        vocab = logp.shape[1]
        pad_only = torch.full_like(logp[0], float("-inf"))
        pad_only[pad_id] = 0.0
        logp = torch.where(finished[:, None], pad_only, logp)
        total = (scores.reshape(-1, 1) + logp).view(b, k * vocab)
        best, choice = torch.sort(total, dim=1, descending=True, stable=True)
        scores, choice = best[:, :k], choice[:, :k]
        source = (torch.arange(b, device=device)[:, None] * k + choice // vocab).reshape(-1)
        token = (choice % vocab).reshape(-1)
        ids = torch.cat([ids.index_select(0, source), token[:, None]], dim=1)
        finished = finished.index_select(0, source) | (token == end_id)
        stepper.keep(source)
        if t == steps - 1 or all_done(finished):
            break
        logits = stepper.next(ids)
    generated = ((ids[:, prompt:] != pad_id) | (ids[:, prompt:] == end_id)).sum(dim=1).clamp(min=1)
    ranked = scores.reshape(-1) / generated.float() ** decoding.length_penalty
    best_beam = torch.sort(ranked.view(b, k), dim=1, descending=True, stable=True).indices[:, 0]
    return ids.view(b, k, -1)[torch.arange(b, device=device), best_beam]
