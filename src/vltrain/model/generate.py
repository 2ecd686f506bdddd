"""Caption generation: greedy, beam search and nucleus (top-p) sampling over a captioning model's
decoder, batched, with cached keys and values.

The search calls the model through ``run(computation)``: the wrapped task (``Task.forward``, so that
FSDP2 gathers the parameters) or :func:`vltrain.model.passes.direct` for a bare model. Each
computation is one of
:class:`~vltrain.model.passes.CaptionStart` (``VLModel.caption_start``: the prompt, the image's cross-attention keys and
values computed once), :class:`CaptionStep` (one new position on the cache) or, with
``cache=False``, :class:`CaptionNext` (every position recomputed: what the cache is measured
against).

Beam search is transformers' ``generate`` (``num_beams``, ``length_penalty``, ``early_stopping`` off),
step for step, so that an imported checkpoint captions as it does there (``tests/model/test_generate.py``
compares the two on the same logits).

Deterministic: greedy breaks ties towards the lower token id, beam search ranks with ``torch.topk`` as
transformers does, and top-p draws each image's numbers from a generator seeded by ``seed`` and the
image's index in its list, so an image gets the same caption whichever batch, rank or world size it
falls in (to the rounding of batched matmuls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from vltrain.errors import UsageError
from vltrain.model.passes import CaptionNext, CaptionStart, CaptionStep
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
        """One line for a setting that cannot work, naming it: a usage error (exit 2)."""
        if self.beam < 1:
            raise UsageError(f"--beam must be >= 1 (1: greedy), got {self.beam}")
        if self.top_p and self.beam > 1:
            raise UsageError("--top-p samples one caption per image; it does not combine with --beam")
        if not 0 <= self.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.max_length > context:
            raise UsageError(f"--max-length {self.max_length} exceeds the model's text context of {context} tokens")
        if prompt_length >= context:
            raise UsageError(f"the prompt takes {prompt_length} tokens with the start token, and the model's text "
                            f"context is {context}: shorten the prompt")
        if prompt_length >= self.max_length:
            raise UsageError(f"the prompt takes {prompt_length} tokens with the start token, which leaves none of "
                            f"--max-length {self.max_length} to generate: raise --max-length (up to {context})")


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
    return [_trim(row, end_id, len(prompt)) for row in out.tolist()]


def _trim(row: list[int], end_id: int, prompt_length: int) -> list[int]:
    """The row up to and including its first end token past the prompt, where the padding starts.
    A row without one ran to ``max_length`` and holds no padding (a token of the padding's id it
    generated stays, as transformers keeps it)."""
    for i in range(prompt_length, len(row)):
        if row[i] == end_id:
            return row[: i + 1]
    return row


class _Stepper:
    """The calls of one generation: cached (start, then one position at a time) or recomputed."""

    def __init__(self, run: Callable, image_tokens: Tokens, has_image: torch.Tensor, cache: bool):
        self.run, self.image_tokens, self.has_image, self.cached = run, image_tokens, has_image, cache
        self.cache = None

    def first(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cached:
            logits, self.cache = self.run(CaptionStart(self.image_tokens, self.has_image, ids))
            return logits
        return self.run(CaptionNext(ids, self.image_tokens, self.has_image))

    def next(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cached:
            return self.run(CaptionStep(ids[:, -1:], self.cache))
        return self.run(CaptionNext(ids, self.image_tokens, self.has_image))

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
    """Beam search as transformers' ``generate`` does it (``num_beams``, ``length_penalty``,
    ``early_stopping=False``), so that a checkpoint captions here as it does there: each step ranks
    the 2k best continuations of the k running beams by total log-probability. Of the first k of
    them, those that end (``end_id``, or ``max_length`` reached) join the image's k best finished
    captions, scored by log-probability / generated tokens ** ``length_penalty``; the best k that do
    not end run on. An image stops when it has k finished captions and its best running beam, scored
    at its present length, cannot beat the worst of them. Returns each image's best finished caption,
    padded."""
    b, k, prompt = ids.shape[0], decoding.beam, ids.shape[1]
    device, lp = ids.device, decoding.length_penalty
    rows = torch.arange(b, device=device).repeat_interleave(k)
    stepper = _Stepper(run, image_tokens.index_select(rows), torch.ones(b * k, dtype=torch.bool, device=device),
                       decoding.cache)
    ids = ids.index_select(0, rows)
    logits = stepper.first(ids)
    running = torch.zeros(b, k, device=device)
    running[:, 1:] = _NONE  # the beams start equal: only the first one is extended at first
    best = _Finished(b, k, decoding.max_length, pad_id, device)
    improvable = torch.ones(b, dtype=torch.bool, device=device)
    first_k = torch.arange(2 * k, device=device) < k
    offset = torch.arange(b, device=device)[:, None] * k
    for length in range(prompt, decoding.max_length):
        logp = logits.float().log_softmax(dim=-1)
        vocab = logp.shape[1]
        total = (logp.view(b, k, vocab) + running[:, :, None]).view(b, k * vocab)
        top, choice = torch.topk(total, 2 * k)
        source = offset + choice // vocab  # [b, 2k]: the flat beam each candidate continues
        candidates = torch.cat([ids[source], (choice % vocab)[..., None]], dim=2)
        ends = (candidates[..., -1] == end_id) | (length + 1 >= decoding.max_length)
        score = top / float(length + 1 - prompt) ** lp
        best.add(candidates, torch.where(ends & first_k & improvable[:, None], score, _NONE))
        running, keep = torch.topk(top + ends.float() * _NONE, k)
        kept = source.gather(1, keep).reshape(-1)
        ids = candidates.gather(1, keep[..., None].expand(-1, -1, candidates.shape[2])).reshape(b * k, -1)
        # an image can still improve while a running beam, at its present length, beats its worst finished one
        worst = torch.where(best.scores > _NONE, best.scores.min(dim=1).values[:, None], _NONE)
        improvable = improvable & (running[:, :1] / float(length + 1 - prompt) ** lp > worst).any(dim=1)
        if length + 1 >= decoding.max_length or all_done(~improvable):
            break
        stepper.keep(kept)
        logits = stepper.next(ids)
    return best.ids[:, 0]


_NONE = -1.0e9
"""The score of a beam that cannot be chosen (transformers' value, so that sums rank alike)."""


class _Finished:
    """Each image's ``k`` best finished captions (ids padded to ``length``) and their scores, best first."""

    def __init__(self, b: int, k: int, length: int, pad_id: int, device: torch.device):
        self.pad_id = pad_id
        self.ids = torch.full((b, k, length), pad_id, dtype=torch.long, device=device)
        self.scores = torch.full((b, k), _NONE, device=device)  # _NONE: no caption in that place yet

    def add(self, candidates: torch.Tensor, scores: torch.Tensor) -> None:
        """Merge ``candidates`` [b, n, t] whose ``scores`` [b, n] are above ``_NONE`` (the others are not finished)."""
        padded = torch.full((*candidates.shape[:2], self.ids.shape[2]), self.pad_id, dtype=torch.long,
                            device=candidates.device)
        padded[..., :candidates.shape[2]] = candidates
        merged = torch.cat([self.scores, scores], dim=1)
        self.scores, pick = torch.topk(merged, self.scores.shape[1])
        self.ids = torch.cat([self.ids, padded], dim=1).gather(1, pick[..., None].expand(-1, -1, self.ids.shape[2]))
