"""LocCa's decoder (SigLIP 2, section 2.2): a transformer of its own beside the two towers that reads
the image's un-pooled tokens and writes three things about them:

- a caption: the task token, then the caption;
- a referring expression's box: the task token and a region's phrase, then the box as four tokens;
- a grounded caption: the task token and a region's box, then its phrase.

Its vocabulary is the tokenizer's, then ``box_bins`` box tokens, then four tokens of its own: one
per task and the mask token of parallel prediction (:class:`vltrain.boxes.LocCaVocab`).

A row is decoded one of two ways. Causal: each position sees those before it and predicts the
next token, as a captioner does. Parallel (CapPa): the target's tokens are replaced by mask
tokens, every position sees every other, and each mask position predicts its own token at once.
The prefix (the task, the phrase or the box) is given in both. :func:`vltrain.boxes.task_rows`
writes either form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vltrain.boxes import BOX_TOKENS, LocCaVocab, TaskRows, from_bins, ordered, task_rows, to_bins
from vltrain.model.blocks import key_padding_mask
from vltrain.model.decoder import CaptionDecoder, DecoderConfig
from vltrain.model.passes import LocCaLogits
from vltrain.types import Tokens

class LocCaDecoder(CaptionDecoder):
    """:class:`CaptionDecoder`'s layers over ids it embeds itself: a token embedding of
    :class:`LocCaVocab`'s size and a learned position embedding of ``max_length`` positions."""

    def __init__(self, cfg: DecoderConfig, width: int, image_width: int, text_vocab: int, max_length: int):
        vocab = LocCaVocab(text_vocab, cfg.box_bins)
        embedding = nn.Embedding(vocab.size, width)
        super().__init__(cfg, width, image_width, vocab.size, embedding if cfg.tied else None)
        self.vocab = vocab
        self.max_length = max_length
        self.token_embedding = embedding
        nn.init.normal_(self.token_embedding.weight, std=0.02)
        self.positional_embedding = nn.Parameter(torch.randn(max_length, width) * 0.01)

    def rows(self, rows: TaskRows, image_tokens: Tokens, has_image: torch.Tensor) -> torch.Tensor:
        """[B, L, V] logits of ``rows``, each causal or parallel as it says."""
        return F.linear(self.row_states(rows, image_tokens, has_image), *self.vocabulary)

    def row_states(self, rows: TaskRows, image_tokens: Tokens, has_image: torch.Tensor) -> torch.Tensor:
        """[B, L, W] what the map to the vocabulary reads of ``rows`` (:meth:`rows` without the map)."""
        length = rows.ids.shape[1]
        if length > self.max_length:
            raise ValueError(f"a decoder row of {length} tokens exceeds the decoder's {self.max_length} positions")
        x = self.token_embedding(rows.ids) + self.positional_embedding[:length]
        causal = key_padding_mask(rows.attention_mask, causal=True)
        full = key_padding_mask(rows.attention_mask)
        mask = torch.where(rows.parallel[:, None, None, None], full, causal)
        return self.states(x, rows.attention_mask, image_tokens, has_image, mask=mask)

    def flops(self, length: int, image_tokens: int, vocab_size: int) -> float:
        return super().flops(length, image_tokens, self.vocab.size)


def _greedy(run, rows: TaskRows, image_tokens: Tokens, steps: int, allowed: tuple[int, int], end_id: int | None
            ) -> torch.Tensor:
    """``steps`` tokens after each row of ``rows`` (causal, every position recomputed), each the most
    likely among ids ``allowed`` [lo, hi); a row that wrote ``end_id`` writes padding after it."""
    ids, attention = rows.ids, rows.attention_mask
    length = attention.sum(dim=1)
    out = []
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    has_image = torch.ones(len(ids), dtype=torch.bool, device=ids.device)
    for _ in range(steps):
        logits = run(LocCaLogits(TaskRows(ids, attention, rows.labels, rows.parallel), image_tokens, has_image))
        last = logits.gather(1, (length - 1)[:, None, None].expand(-1, 1, logits.shape[-1]))[:, 0]
        token = last[:, allowed[0]:allowed[1]].argmax(dim=-1) + allowed[0]
        token = torch.where(done, torch.full_like(token, -1), token)
        out.append(token)
        if end_id is not None:
            done |= token == end_id
        ids = torch.cat([ids, ids.new_zeros(len(ids), 1)], dim=1)
        attention = torch.cat([attention, attention.new_zeros(len(ids), 1)], dim=1)
        rows_at = torch.arange(len(ids), device=ids.device)
        ids[rows_at, length] = token.clamp(min=0)
        attention[rows_at, length] = 1
        length = length + 1
    return torch.stack(out, dim=1)


def ground(run, vocab: LocCaVocab, image_tokens: Tokens, phrases: torch.Tensor, phrase_len: torch.Tensor,
           pad_id: int, parallel: bool = False) -> torch.Tensor:
    """float [B, 4]: the box (in [0, 1] of the image as the model sees it) the decoder writes for each
    image's phrase ``phrases`` [B, P] (its first ``phrase_len``): a referring expression decoded
    causally, each coordinate the most likely box token; ``parallel``: all four at once from mask
    tokens (a decoder trained with ``parallel_prediction`` 1 has never decoded causally)."""
    b = len(phrases)
    none = torch.zeros(b, dtype=torch.long, device=phrases.device)
    box = (vocab.box, vocab.box + vocab.bins)
    if not parallel:
        rows = task_rows(vocab.referring, phrases, phrase_len, phrases[:, :0], none, none.bool(), vocab, pad_id)
        tokens = _greedy(run, rows, image_tokens, BOX_TOKENS, box, None)
        return ordered(from_bins(tokens - vocab.box, vocab.bins))
    masks = torch.full((b, BOX_TOKENS), vocab.mask, dtype=torch.long, device=phrases.device)
    every = torch.ones(b, dtype=torch.bool, device=phrases.device)
    rows = task_rows(vocab.referring, phrases, phrase_len, masks, none + BOX_TOKENS, every, vocab, pad_id)
    logits = run(LocCaLogits(rows, image_tokens, every))
    at = 1 + phrase_len[:, None] + torch.arange(BOX_TOKENS, device=phrases.device)[None]
    picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))[..., box[0]:box[1]]
    return ordered(from_bins(picked.argmax(dim=-1), vocab.bins))


def describe(run, vocab: LocCaVocab, image_tokens: Tokens, boxes: torch.Tensor, max_tokens: int, end_id: int,
             pad_id: int) -> list[list[int]]:
    """The phrase (token ids, up to ``end_id``) the decoder writes for each image's box ``boxes``
    [B, 4] (in [0, 1] of the image as the model sees it): a grounded caption, decoded greedily."""
    b = len(boxes)
    four = torch.full((b,), BOX_TOKENS, dtype=torch.long, device=boxes.device)
    prefix = vocab.box + to_bins(boxes, vocab.bins)
    causal = torch.zeros(b, dtype=torch.bool, device=boxes.device)
    rows = task_rows(vocab.grounded, prefix, four, prefix[:, :0], four * 0, causal, vocab, pad_id)
    tokens = _greedy(run, rows, image_tokens, max_tokens, (0, vocab.text), end_id)
    return [[t for t in row if t >= 0] for row in tokens.tolist()]


def caption(run, vocab: LocCaVocab, image_tokens: Tokens, max_tokens: int, end_id: int, pad_id: int
            ) -> list[list[int]]:
    """Each image's caption (token ids, up to ``end_id``), decoded greedily after the caption task token."""
    b = len(image_tokens)
    none = torch.zeros(b, dtype=torch.long, device=image_tokens.values.device)
    empty = none[:, None][:, :0]
    rows = task_rows(vocab.caption, empty, none, empty, none, none.bool(), vocab, pad_id)
    tokens = _greedy(run, rows, image_tokens, max_tokens, (0, vocab.text), end_id)
    return [[t for t in row if t >= 0] for row in tokens.tolist()]
