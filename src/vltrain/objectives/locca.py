"""LocCa's three objectives on its decoder (SigLIP 2, section 2.2; :mod:`vltrain.model.locca`):

- ``caption``: every row with text, reading its image (a plain language model on a text-only row);
- ``referring``: a row's region, its phrase in and its box out;
- ``grounded_caption``: the same region, its box in and its phrase out.

A row with regions trains the last two on one of them a step: which one is drawn keyed by (seed,
step, sample id), and so is whether each of the row's three tasks is decoded causally or in
parallel (``loss.parallel_prediction``), so the same row gets the same draws whichever rank and
micro-batch it lands in, and after a resume. Each loss is a mean over its target tokens in the whole step
(its denominator is summed over every rank and micro-batch first, :meth:`LocCaTasks.totals`).

The three tasks' rows run through the decoder in one pass, concatenated, so every rank calls the
decoder once a micro-batch whatever its rows hold (FSDP2 gathers its layers once per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vltrain.boxes import BOX_TOKENS, LocCaVocab, TaskRows, task_rows, to_bins
from vltrain.objectives.keyed import UNKEYED, StepKey, Stream
from vltrain.objectives.chunked import chunked_cross_entropy
from vltrain.objectives.losses import _over, token_cross_entropy
from vltrain.model.config import LossConfig
from vltrain.types import Encoded, ModelInputs, ModelPasses, ModelSpec, RowLosses

TASKS = ("caption", "referring", "grounded_caption")


@dataclass
class Regions:
    """A batch's regions as the objectives read them."""

    boxes: torch.Tensor
    """float [B, R, 4] in [0, 1] of the image as the model sees it."""
    count: torch.Tensor
    """int64 [B]: row i's regions are its first ``count[i]``."""
    ids: torch.Tensor
    """int64 [B, R, Lr]: each region's phrase, tokenized, left-aligned."""
    mask: torch.Tensor
    """int64 [B, R, Lr]: 1 on a phrase's tokens."""


def batch_regions(inputs: ModelInputs) -> Regions | None:
    """The regions ``inputs`` carries: boxes with their images (``Images.boxes``, the real ones first
    in each row), phrases beside them (``ModelInputs.region_ids``); None when no row has one."""
    images = inputs.images
    if images.boxes is None or inputs.region_ids is None:
        return None
    return Regions(images.boxes, images.box_mask.long().sum(dim=1), inputs.region_ids, inputs.region_attention_mask)


@dataclass
class Picked:
    """Each row's region for this step (rows ``rows`` of the batch, those with one)."""

    rows: torch.Tensor
    """int64 [n]: the rows with a region."""
    box: torch.Tensor
    """int64 [n, 4]: its box as box tokens."""
    phrase: torch.Tensor
    """int64 [n, Lr]"""
    phrase_len: torch.Tensor
    """int64 [n]"""


class LocCaTasks:
    """LocCa's weighted objectives for a decoder of vocabulary ``vocab``."""

    def __init__(self, weights: dict[str, float], parallel: float, vocab: LocCaVocab, pad_id: int,
                 label_smoothing: float = 0.0, chunk: int = 0):
        self.weights = {k: v for k, v in weights.items() if k in TASKS and v > 0}
        self.parallel = parallel
        self.vocab = vocab
        self.pad_id = pad_id
        self.label_smoothing = label_smoothing
        self.chunk = chunk
        """``loss.caption_chunk``: the logits this many tokens at a time (0: all at once)."""

    @staticmethod
    def of(weights: dict[str, float], loss: LossConfig, spec: ModelSpec) -> "LocCaTasks | None":
        """The tasks of a model with a LocCa decoder (``spec.box_bins``), with the weights > 0 of
        ``weights``; None for any other model."""
        if not spec.box_bins:
            return None
        return LocCaTasks(weights, loss.parallel_prediction, LocCaVocab(spec.vocab_size, spec.box_bins), spec.pad_id,
                          loss.caption_label_smoothing, loss.caption_chunk)

    def pick(self, inputs: ModelInputs, key: StepKey) -> Picked | None:
        """Each row's region for the step, drawn keyed by its id among its first ``count`` (rows with
        an image and at least one region); None when no row has one."""
        regions = batch_regions(inputs)
        if regions is None:
            return None
        count = regions.count * inputs.has_image.long()
        rows = count.nonzero().squeeze(1)
        u = key.uniform(Stream.LOCCA_REGION, inputs.ids.index_select(0, rows), 1)[:, 0]
        n = count.index_select(0, rows)
        r = (u * n.float()).long().clamp(max=n - 1) if rows.numel() else n
        box = self.vocab.box + to_bins(regions.boxes[rows, r], self.vocab.bins)
        mask = regions.mask[rows, r]
        return Picked(rows, box, regions.ids[rows, r], mask.sum(dim=1))

    def _caption_target(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [B, L], lengths [B]): each caption's tokens, none on a row without text."""
        length = inputs.attention_mask.long().sum(dim=1) * inputs.has_text.long()
        return inputs.input_ids, length

    def rows(self, inputs: ModelInputs, key: StepKey) -> tuple[TaskRows, torch.Tensor, torch.Tensor]:
        """The decoder's rows of the three tasks, concatenated (captions of every row first, then
        referring and grounded captions of the rows with a region), and for each its task (0, 1, 2)
        and the batch row it came from."""
        b = len(inputs)
        device = inputs.ids.device
        parallel = key.uniform(Stream.LOCCA_PARALLEL, inputs.ids, len(TASKS)) < self.parallel
        target, length = self._caption_target(inputs)
        empty = target[:, :0]
        zero = torch.zeros(b, dtype=torch.long, device=device)
        parts = [task_rows(self.vocab.caption, empty, zero, target, length, parallel[:, 0], self.vocab, self.pad_id)]
        source = [torch.arange(b, device=device)]
        picked = self.pick(inputs, key)
        if picked is not None:
            n = picked.rows.numel()
            four = torch.full((n,), BOX_TOKENS, dtype=torch.long, device=device)
            on = lambda name, t: t if name in self.weights else torch.zeros_like(t)  # noqa: E731
            rows_parallel = parallel.index_select(0, picked.rows)
            parts.append(task_rows(self.vocab.referring, picked.phrase, picked.phrase_len, picked.box,
                                   on("referring", four), rows_parallel[:, 1], self.vocab, self.pad_id))
            parts.append(task_rows(self.vocab.grounded, picked.box, four, picked.phrase,
                                   on("grounded_caption", picked.phrase_len), rows_parallel[:, 2], self.vocab,
                                   self.pad_id))
            source += [picked.rows, picked.rows]
        task = torch.cat([torch.full((len(p.ids),), i, dtype=torch.long, device=device) for i, p in enumerate(parts)])
        return _cat(parts, self.pad_id), task, torch.cat(source)

    def totals(self, inputs: ModelInputs, weights: torch.Tensor) -> dict[str, torch.Tensor]:
        """The weighted target tokens of each task in this micro-batch (a step's denominators)."""
        key = inputs.key or UNKEYED
        _, length = self._caption_target(inputs)
        out = {"caption": (length.float() * weights).sum()}
        picked = self.pick(inputs, key)
        w = weights.index_select(0, picked.rows) if picked is not None else weights[:0]
        out["referring"] = (w * BOX_TOKENS).sum()
        out["grounded_caption"] = (w * picked.phrase_len.float()).sum() if picked is not None else w.sum()
        return {k: v for k, v in out.items() if k in self.weights}

    def score(self, passes: ModelPasses, enc: Encoded, inputs: ModelInputs, denominators: dict,
              row_losses: dict) -> dict[str, torch.Tensor]:
        """Each task's loss: cross-entropy over its target tokens, weighted by the rows' weights,
        over ``denominators[name]`` (the step's; None: this micro-batch's own)."""
        key = inputs.key or UNKEYED
        rows, task, source = self.rows(inputs, key)
        image = enc.image_tokens if len(rows.ids) == len(inputs) else enc.image_tokens.index_select(source)
        has_image = inputs.has_image.index_select(0, source)
        if self.chunk:  # never the [N, L, V] logits
            out = passes.locca_readout(rows, image, has_image)
            ce = chunked_cross_entropy(out.hidden, out.weight, out.bias, rows.labels, self.label_smoothing, self.chunk)
        else:
            logits = passes.locca_logits(rows, image, has_image)
            ce = token_cross_entropy(logits, rows.labels, self.label_smoothing).view_as(rows.labels)
        picked = rows.labels != -100
        w = torch.ones(len(inputs), device=ce.device) if inputs.row_weights is None else inputs.row_weights.float()
        token_w = picked.float() * w.index_select(0, source)[:, None]
        per_row = (ce.detach() * picked).sum(dim=1) / picked.sum(dim=1).clamp(min=1)
        out = {}
        for i, name in enumerate(TASKS):
            if name not in self.weights:
                continue
            mine = task == i
            of_task = token_w * mine.float()[:, None]
            denominator = denominators.get(name)  # None: this micro-batch's own
            out[name] = _over((ce * of_task).sum(), of_task.sum() if denominator is None else denominator)
            values = torch.zeros(len(inputs), device=ce.device).index_add(0, source[mine], per_row[mine])
            applies = torch.zeros(len(inputs), dtype=torch.bool, device=ce.device)
            applies[source[mine]] = picked[mine].any(dim=1)
            row_losses[name] = RowLosses(values, applies)
        return out


def _cat(parts: list[TaskRows], pad_id: int) -> TaskRows:
    """Rows of several :class:`TaskRows`, padded to the longest."""
    length = max(p.ids.shape[1] for p in parts)

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:
        return F.pad(t, (0, length - t.shape[1]), value=value)

    return TaskRows(torch.cat([pad(p.ids, pad_id) for p in parts]),
                    torch.cat([pad(p.attention_mask, 0) for p in parts]),
                    torch.cat([pad(p.labels, -100) for p in parts]),
                    torch.cat([p.parallel for p in parts]))
