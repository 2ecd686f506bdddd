"""Boxes as LocCa reads and writes them: ``(x0, y0, x1, y1)`` in [0, 1] of the image as the model
sees it (x over its width, y over its height), their coordinates as tokens, and their overlap.

A coordinate becomes one of ``bins`` tokens (Pix2Seq's and LocCa's quantization, 1,000 bins in
both): bin ``k`` covers ``[k / bins, (k + 1) / bins)``, and reads back as its centre. Four tokens
make a box, in the order x0, y0, x1, y1.

Here too are the rows LocCa's decoder reads (:func:`task_rows`), written in its vocabulary
(:class:`LocCaVocab`): the objectives build them and the model decodes them.

It sits in the bottom layer, beside ``images.py``: the loader maps boxes through its resizes, the
model's decoder writes them as tokens, the objectives train it to, evaluation scores them, and none
imports the others for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def to_bins(boxes: torch.Tensor, bins: int) -> torch.Tensor:
    """int64 [..., 4]: each coordinate of ``boxes`` [..., 4] (in [0, 1]) as its bin, in [0, bins)."""
    return (boxes.float() * bins).floor().long().clamp(0, bins - 1)


def from_bins(tokens: torch.Tensor, bins: int) -> torch.Tensor:
    """float32 [..., 4]: the centres of bins ``tokens`` [..., 4] (each in [0, bins))."""
    return (tokens.float() + 0.5) / bins


def ordered(boxes: torch.Tensor) -> torch.Tensor:
    """``boxes`` [..., 4] with each pair of coordinates in order (x0 <= x1, y0 <= y1): a decoder may
    write the corners either way round."""
    x0, y0, x1, y1 = boxes.unbind(-1)
    return torch.stack([torch.minimum(x0, x1), torch.minimum(y0, y1), torch.maximum(x0, x1), torch.maximum(y0, y1)], -1)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[...] intersection over union of boxes ``a`` and ``b`` [..., 4] pairwise (0 where both are empty)."""
    a, b = ordered(a.float()), ordered(b.float())
    w = (torch.minimum(a[..., 2], b[..., 2]) - torch.maximum(a[..., 0], b[..., 0])).clamp(min=0)
    h = (torch.minimum(a[..., 3], b[..., 3]) - torch.maximum(a[..., 1], b[..., 1])).clamp(min=0)
    inter = w * h
    area = lambda t: (t[..., 2] - t[..., 0]) * (t[..., 3] - t[..., 1])  # noqa: E731
    union = area(a) + area(b) - inter
    return torch.where(union > 0, inter / union.clamp(min=1e-12), torch.zeros_like(union))


BOX_TOKENS = 4
"""x0, y0, x1, y1."""


@dataclass(frozen=True)
class LocCaVocab:
    """Where each kind of token sits in the decoder's vocabulary: the tokenizer's ``text`` ids, then
    ``bins`` box tokens, then the caption, referring and grounded caption task tokens and the mask."""

    text: int
    bins: int

    @property
    def box(self) -> int:
        """The id of bin 0."""
        return self.text

    @property
    def caption(self) -> int:
        return self.text + self.bins

    @property
    def referring(self) -> int:
        return self.caption + 1

    @property
    def grounded(self) -> int:
        return self.caption + 2

    @property
    def mask(self) -> int:
        return self.caption + 3

    @property
    def size(self) -> int:
        return self.caption + 4

    def is_box(self, ids: torch.Tensor) -> torch.Tensor:
        return (ids >= self.box) & (ids < self.box + self.bins)


@dataclass
class TaskRows:
    """One decoder batch: each row the task token, its prefix and its target, causal or parallel."""

    ids: torch.Tensor
    """int64 [B, L]: the decoder's input."""
    attention_mask: torch.Tensor
    """int64 [B, L]: 1 on the row's tokens."""
    labels: torch.Tensor
    """int64 [B, L]: the token each position predicts (-100: none). Causal rows: the next token of the
    target; parallel rows: the target token the position masks."""
    parallel: torch.Tensor
    """bool [B]."""


def _place(ids: torch.Tensor, values: torch.Tensor, start: torch.Tensor, count: torch.Tensor) -> None:
    """Writes row i's first ``count[i]`` ``values`` [B, n] into ``ids`` [B, L] from column ``start[i]``."""
    n = values.shape[1]
    if n == 0:
        return
    j = torch.arange(n, device=ids.device)
    cols = start[:, None] + j[None, :]
    keep = j[None, :] < count[:, None]
    rows = torch.arange(ids.shape[0], device=ids.device)[:, None].expand_as(cols)
    ids[rows[keep], cols[keep]] = values[keep]


def task_rows(task: torch.Tensor | int, prefix: torch.Tensor, prefix_len: torch.Tensor, target: torch.Tensor,
              target_len: torch.Tensor, parallel: torch.Tensor, vocab: LocCaVocab, pad_id: int) -> TaskRows:
    """The rows ``[task, prefix[:prefix_len], target[:target_len]]`` (``prefix`` [B, P] and ``target``
    [B, T] int64, left-aligned; a row with ``target_len`` 0 predicts nothing), the target written
    as mask tokens in the ``parallel`` rows."""
    b, p, t = prefix.shape[0], prefix.shape[1], target.shape[1]
    device = prefix.device
    length = 1 + p + t
    ids = torch.full((b, length), pad_id, dtype=torch.long, device=device)
    ids[:, 0] = task
    one = torch.ones(b, dtype=torch.long, device=device)
    _place(ids, prefix, one, prefix_len)
    shown = torch.where(parallel[:, None], torch.full_like(target, vocab.mask), target)
    _place(ids, shown, 1 + prefix_len, target_len)
    labels = torch.full((b, length), -100, dtype=torch.long, device=device)
    # causal rows: the position before each target token predicts it; parallel rows: its own position
    _place(labels, target, prefix_len + parallel.long(), target_len)
    pos = torch.arange(length, device=device)
    attention = (pos[None, :] < (1 + prefix_len + target_len)[:, None]).long()
    return TaskRows(ids, attention, labels, parallel)
