"""The objectives: given what the model encoded, which losses a step computes, on which rows, with
which weights.

Parameter-free, and given tensors: no model class is imported here. ITC and SigLIP score the
towers' embeddings with the model's temperature (:mod:`vltrain.objectives.losses`, or around a ring of
ranks with :mod:`vltrain.objectives.ring`). ITM draws hard negatives from the similarity matrix and
scores the ITM logits the model gives for positives and negatives; MLM masks captions and scores the
logits of the model's MLM pass over them; text MLM and MIM likewise; SILC and TIPS score the
prototype logits of the step's views (:mod:`vltrain.objectives.selfdist`). Those passes reach the
objectives as :class:`vltrain.types.ModelPasses` (why, there): the objectives choose each pass's
inputs and score its output, and call no tower or head. An objective runs only where the model
has its head (``build_model`` decides; :class:`vltrain.types.ModelSpec` says which).

Splitting the contrastive term from the rest serves gradient-cached accumulation: ``score(passes,
enc, inputs)`` is the contrastive term plus ``score(..., contrastive=False)``: the exact gradient.

Nothing here depends on how a step is split among ranks and micro-batches
(docs/distributed.md#the-global-batch):

- ITM negatives, MLM masks and MIM masks are drawn from numbers keyed by the seed, the step and the
  sample id (:mod:`vltrain.objectives.keyed`), never from a generator whose state depends on what
  the rank drew before;
- with ``itm_negatives: group`` a row's negatives come from its group, a fixed run of consecutive
  rows of the global batch that no split cuts through;
- ITM, MLM, MIM, SILC and TIPS are weighted means over the whole step: the trainer sums every
  micro-batch's denominator over the ranks (:meth:`Objectives.local_totals`) and hands it in with the
  key; the masks and views counted are those scored, drawn once (:meth:`Objectives.draw`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vltrain.model.config import LossConfig, SelfDistSettings, VisionSettings
from vltrain.objectives.chunked import chunked_cross_entropy
from vltrain.objectives.distill import distill_loss, distill_sigmoid_loss
from vltrain.objectives.keyed import UNKEYED, Stream
from vltrain.objectives.locca import TASKS as LOCCA_TASKS
from vltrain.objectives.locca import LocCaTasks
from vltrain.objectives.losses import (itc_loss, itm_loss, mask_tokens, mim_loss, mlm_loss, sample_negatives, scale_of,
                                       siglip_loss, token_cross_entropy, token_mean)
from vltrain.objectives.ring import itc_loss_ring, siglip_loss_ring
from vltrain.objectives.selfdist import SelfDistillation, Views
from vltrain.pixels import kept_patches
from vltrain.runtime.distributed import all_gather_no_grad, all_gather_with_grad, exchange_shapes, pad_to
from vltrain.runtime.precision import at_least_fp32
from vltrain.types import Encoded, ModelInputs, ModelPasses, ModelSpec, RowLosses, Rows, Tokens


@dataclass
class ObjectiveOutput:
    loss: torch.Tensor
    """Weighted sum of ``losses`` (plus the zero-valued anchor)."""
    losses: dict[str, torch.Tensor]
    """Unweighted per-objective values: itc, siglip, itm, mlm (those the model has)."""
    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    logit_scale: torch.Tensor
    """exp(logit_scale), clamped: the inverse temperature in use."""
    itm_logits: torch.Tensor | None = None
    rows: dict[str, "RowLosses"] = field(default_factory=dict)
    """Each objective's unweighted loss per row, for per-source metrics."""


@dataclass
class Masks:
    """One micro-batch's keyed masks (:meth:`Objectives.draw`): drawn once a step, counted for the
    step's denominators and scored with; None where the objective is off."""

    mlm: tuple[torch.Tensor, torch.Tensor] | None = None
    """(masked ids, labels) for MLM through the fusion encoder; labels -100 off the image-text rows."""
    text_mlm: tuple[torch.Tensor, torch.Tensor] | None = None
    """(masked ids, labels) for text MLM; labels -100 off the rows it applies to."""
    image_mim: torch.Tensor | None = None
    """[B, patches] (bool) SimMIM's patch mask of every row; the rows it applies to pick from it."""
    views: Views | None = None  # SILC's and TIPS's views (with the EMA teacher's targets, once it has seen them)


def _present_rows(applies: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The indices of the rows where ``applies`` (one host synchronization: their count)."""
    return (index := applies.nonzero().squeeze(1)), index.numel()


def _scatter(values: torch.Tensor, index: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """Per-row values of the selected rows back at their rows of a batch of ``b`` (zeros elsewhere)."""
    return values.new_zeros(b).index_copy(0, index, values[:n]) if n else values.new_zeros(b)


@dataclass
class ITMPairs:
    """The 3B fusion inputs of one ITM step: B positives, B (image, hard negative text), B (hard
    negative image, text)."""

    text_tokens: torch.Tensor
    attention_mask: torch.Tensor
    image_tokens: Tokens
    labels: torch.Tensor
    pair_weights: torch.Tensor
    negative_text_ids: torch.Tensor
    negative_image_ids: torch.Tensor


@dataclass
class _Columns:
    """What ITM draws its negatives from: this rank's batch, or every rank's (rank order)."""

    image_tokens: Tokens
    text_tokens: torch.Tensor
    attention_mask: torch.Tensor
    image_embeds: torch.Tensor
    text_embeds: torch.Tensor
    ids: torch.Tensor
    has_image: torch.Tensor
    has_text: torch.Tensor

    @staticmethod
    def gather(enc: Encoded, inputs: ModelInputs, global_: bool) -> "_Columns":
        meta = torch.stack([inputs.ids, inputs.has_image.long(), inputs.has_text.long()], dim=1)
        image = enc.image_tokens
        parts = (image.values, enc.text_tokens, inputs.attention_mask, enc.image_embeds, enc.text_embeds, meta)
        if image.real is not None:  # every rank alike: the layout is the config's
            parts += (image.real,)
        if global_:
            shapes = exchange_shapes(*parts)  # one exchange; text widths differ between ranks
            grad = (True, True, False, False, False, False, False)
            parts = tuple((all_gather_with_grad if g else all_gather_no_grad)(x, s)
                          for x, s, g in zip(parts, shapes, grad))
        values, *tensors, meta = parts[:6]
        image = Tokens(values, parts[6] if len(parts) > 6 else None)
        return _Columns(image, *tensors, meta[:, 0], meta[:, 1].bool(), meta[:, 2].bool())


def _denominator(inputs: ModelInputs, name: str) -> torch.Tensor | None:
    """The step's denominator of objective ``name``, when the trainer gave one."""
    totals = inputs.key.totals if inputs.key is not None else None
    return totals.get(name) if totals else None


class Objectives:
    """The weighted objectives of one model (``spec``): ``loss_weights``, those > 0 it has heads for."""

    def __init__(self, loss: LossConfig, spec: ModelSpec, vision: VisionSettings | None = None,
                 selfdist: SelfDistSettings | None = None):
        w = {"itc": loss.itc, "siglip": loss.siglip, "distill": loss.distill, "distill_sigmoid": loss.distill_sigmoid,
             "silc": loss.silc, "tips": loss.tips}
        w.update({k: getattr(loss, k) for k in ("itm", "mlm", "text_mlm", "image_mim", *LOCCA_TASKS) if k in spec.heads})
        self.loss_weights = {k: v for k, v in w.items() if v > 0}
        self.locca = LocCaTasks.of(self.loss_weights, loss, spec)  # a LocCa decoder's tasks, the caption included
        self.selfdist = SelfDistillation.of(self.loss_weights, selfdist or SelfDistSettings(), spec)  # SILC, TIPS
        self.spec = spec
        self.text_mlm_paired = loss.text_mlm_paired
        self.image_mim_paired = loss.image_mim_paired
        self.mim_ratio = loss.mim_ratio
        self.mlm_probability = loss.mlm_probability
        self.caption_label_smoothing = loss.caption_label_smoothing
        self.caption_chunk = loss.caption_chunk
        self.itm_negatives = "local" if loss.itm_negatives == "auto" else loss.itm_negatives
        self.itm_group_size = loss.itm_group_size
        """Rows per ITM group (``itm_negatives: group``); 0: the whole micro-batch."""
        self.ring = loss.contrastive_impl == "ring"
        vision = vision or VisionSettings()
        self.patch_dropout, self.patch_dropout_until = vision.patch_dropout, vision.patch_dropout_until

    CONTRASTIVE = ("itc", "siglip", "distill", "distill_sigmoid")
    """The objectives over the global batch's embeddings (gradient caching computes them over the cache)."""

    @property
    def distilling(self) -> bool:
        """Whether an objective reads a teacher's embeddings (``Rows.teacher``)."""
        return "distill" in self.loss_weights or "distill_sigmoid" in self.loss_weights

    @property
    def averaged(self) -> list[str]:
        """The objectives that are weighted means over a step's rows, pairs, tokens or patches
        (all but the contrastive ones, which see the global batch by themselves)."""
        return [k for k in ("itm", "mlm", "text_mlm", "image_mim", *LOCCA_TASKS, "silc", "tips") if k in self.loss_weights]

    # -- contrastive --------------------------------------------------------------------------

    def contrastive_losses(self, image_embeds, text_embeds, rows: Rows, logit_scale: torch.Tensor,
                           logit_bias: torch.Tensor | None, row_losses: dict[str, RowLosses] | None = None
                           ) -> dict[str, torch.Tensor]:
        out = {}
        rows = rows.present()
        itc, siglip = (itc_loss_ring, siglip_loss_ring) if self.ring else (itc_loss, siglip_loss)
        per_row: dict[str, list] = {k: [] for k in self.CONTRASTIVE}
        if "itc" in self.loss_weights:
            out["itc"] = itc(image_embeds, text_embeds, logit_scale, rows, per_row["itc"])
        if "siglip" in self.loss_weights:
            out["siglip"] = siglip(image_embeds, text_embeds, logit_scale, logit_bias, rows, per_row["siglip"])
        if self.distilling and rows.teacher is None:
            raise ValueError("distillation needs the teacher's embeddings on the rows (Rows.teacher)")
        if "distill" in self.loss_weights:
            out["distill"] = distill_loss(image_embeds, text_embeds, logit_scale, rows, per_row["distill"])
        if "distill_sigmoid" in self.loss_weights:
            out["distill_sigmoid"] = distill_sigmoid_loss(image_embeds, text_embeds, logit_scale, logit_bias, rows,
                                                          per_row["distill_sigmoid"])
        if row_losses is not None:
            paired = rows.has_image & rows.has_text
            row_losses.update({k: RowLosses(v[0], paired) for k, v in per_row.items() if v})
        return out

    def contrastive(self, image_embeds, text_embeds, rows: Rows, logit_scale: torch.Tensor,
                    logit_bias: torch.Tensor | None, row_losses: dict[str, RowLosses] | None = None) -> torch.Tensor:
        """The weighted ITC + SigLIP (+ distillation) term on given (e.g. cached, concatenated)
        embeddings, with the model's ``logit_scale`` (and SigLIP's ``logit_bias``)."""
        losses = self.contrastive_losses(image_embeds, text_embeds, rows, logit_scale, logit_bias, row_losses)
        return sum(self.loss_weights[k] * v for k, v in losses.items())

    # -- image-text matching ------------------------------------------------------------------

    def itm_pairs(self, enc: Encoded, inputs: ModelInputs, logit_scale: torch.Tensor) -> ITMPairs:
        """Positives and hard negatives drawn from the similarity matrix of the row's group
        (``itm_negatives: group``), the rank's own batch (``local``) or the global batch (``global``).

        With global negatives the token features of every rank are gathered with a gradient path,
        so a negative from another rank trains that rank's encoders exactly as in one process with
        the global batch. Ranks pad their captions to their own longest, so the gathered text
        tokens and masks are padded to the longest over ranks (masked, so the fusion ignores them),
        and this rank's own rows with them.
        """
        ids = inputs.ids
        b = ids.shape[0]
        key = inputs.key or UNKEYED
        cols = _Columns.gather(enc, inputs, self.itm_negatives == "global")
        text_ok, image_ok = self._itm_allowed(ids, cols.ids, cols.has_image, cols.has_text)
        text_tokens = pad_to(enc.text_tokens, (b, *cols.text_tokens.shape[1:]))
        attention_mask = pad_to(inputs.attention_mask, (b, cols.attention_mask.shape[1]))
        with torch.no_grad():
            scale = scale_of(logit_scale)
            sim_i2t = scale * at_least_fp32(enc.image_embeds.detach()) @ at_least_fp32(cols.text_embeds).t()
            sim_t2i = scale * at_least_fp32(enc.text_embeds.detach()) @ at_least_fp32(cols.image_embeds).t()
        neg_text, text_found = sample_negatives(sim_i2t, ids, cols.ids, text_ok, key.uniform(Stream.ITM_TEXT, ids, 1)[:, 0])
        neg_image, image_found = sample_negatives(sim_t2i, ids, cols.ids, image_ok,
                                                  key.uniform(Stream.ITM_IMAGE, ids, 1)[:, 0])
        valid = (inputs.has_image & inputs.has_text).float()
        return ITMPairs(
            text_tokens=torch.cat([text_tokens, cols.text_tokens.index_select(0, neg_text), text_tokens]),
            attention_mask=torch.cat([attention_mask, cols.attention_mask[neg_text], attention_mask]),
            image_tokens=Tokens.cat([enc.image_tokens, enc.image_tokens, cols.image_tokens.index_select(neg_image)]),
            labels=torch.cat([torch.ones(b, dtype=torch.long, device=ids.device), ids.new_zeros(2 * b)]),
            pair_weights=torch.cat([valid, valid * text_found, valid * image_found]),
            negative_text_ids=cols.ids[neg_text],
            negative_image_ids=cols.ids[neg_image],
        )

    def _itm_allowed(self, ids: torch.Tensor, col_ids: torch.Tensor, col_image: torch.Tensor, col_text: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """[b, n] each: the columns a row may take its negative text and its negative image from
        (the modality, another sample, and with ``group`` the row's group)."""
        other = ids[:, None] != col_ids[None, :]
        if self.itm_negatives == "group":
            size = self.itm_group_size or len(ids)
            group = torch.arange(len(ids), device=ids.device) // size
            other = other & (group[:, None] == group[None, :])
        return other & col_text[None, :], other & col_image[None, :]

    def _itm_total(self, inputs: ModelInputs, weights: torch.Tensor) -> torch.Tensor:
        """The ITM denominator of one micro-batch: each image-text row's weight times its pairs (the
        positive, and each negative its pool holds). Gathers the pool's ids with global negatives."""
        meta = torch.stack([inputs.ids, inputs.has_image.long(), inputs.has_text.long()], dim=1)
        if self.itm_negatives == "global":
            meta = all_gather_no_grad(meta, exchange_shapes(meta)[0])
        text_ok, image_ok = self._itm_allowed(inputs.ids, meta[:, 0], meta[:, 1].bool(), meta[:, 2].bool())
        pairs = 1 + text_ok.any(dim=1).float() + image_ok.any(dim=1).float()
        return (weights * (inputs.has_image & inputs.has_text).float() * pairs).sum()

    def _itm(self, passes: ModelPasses, enc: Encoded, inputs: ModelInputs, row_losses: dict[str, RowLosses]
             ) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = self.itm_pairs(enc, inputs, passes.logit_scale)
        logits = passes.itm_logits(pairs.text_tokens, pairs.attention_mask, pairs.image_tokens)
        w = pairs.pair_weights
        if inputs.row_weights is not None:
            w = w * inputs.row_weights.float().repeat(3)
        ce: list = []
        loss = itm_loss(logits, pairs.labels, w, ce, _denominator(inputs, "itm"))
        per_pair = pairs.pair_weights.view(3, -1)  # a row's positive and its two negatives
        row_losses["itm"] = RowLosses((ce[0].view(3, -1) * per_pair).sum(0) / per_pair.sum(0).clamp(min=1),
                                      per_pair.sum(0) > 0)
        return loss, logits

    # -- masked language modelling ------------------------------------------------------------

    def _mask(self, inputs: ModelInputs, applies: torch.Tensor, text_tower: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """BERT masks keyed by (seed, step, sample id, token position): a caption gets the same
        mask in a step wherever it is and however wide its batch is padded."""
        key = inputs.key or UNKEYED
        streams = ((Stream.TEXT_MLM_PICK, Stream.TEXT_MLM_HOW, Stream.TEXT_MLM_TOKEN) if text_tower
                   else (Stream.MLM_PICK, Stream.MLM_HOW, Stream.MLM_TOKEN))
        width = inputs.input_ids.shape[1]
        masked, labels = mask_tokens(
            inputs.input_ids, inputs.attention_mask, mask_id=self.spec.mask_id, vocab_size=self.spec.vocab_size,
            pad_id=self.spec.pad_id, probability=self.mlm_probability,
            draws=tuple(key.uniform(stream, inputs.ids, width) for stream in streams),
        )
        return masked, labels.masked_fill(~applies[:, None], -100)

    def _text_mlm_rows(self, inputs: ModelInputs) -> torch.Tensor:
        return inputs.has_text & (~inputs.has_image | self.text_mlm_paired)

    def _mim_rows(self, inputs: ModelInputs) -> torch.Tensor:
        return inputs.has_image & (~inputs.has_text | self.image_mim_paired)

    def _patch_mask(self, inputs: ModelInputs) -> torch.Tensor:
        """SimMIM's patch mask of the rows, keyed by (seed, step, sample id, patch), of each image's
        real patches only."""
        images = inputs.images
        patches = images.positions(self.spec.patch_size)
        return images.among_real((inputs.key or UNKEYED).uniform(Stream.MIM_PATCH, inputs.ids, patches) < self.mim_ratio)

    def _mlm(self, passes: ModelPasses, enc: Encoded, inputs: ModelInputs, masks: Masks,
             row_losses: dict[str, RowLosses]) -> torch.Tensor:
        """MLM through the fusion encoder, on image-text rows."""
        paired = inputs.has_image & inputs.has_text
        masked, labels = masks.mlm
        logits = passes.mlm_logits(masked, inputs.attention_mask, enc.image_tokens)
        per_row: list = []
        loss = mlm_loss(logits, labels, inputs.row_weights, per_row, _denominator(inputs, "mlm"))
        row_losses["mlm"] = RowLosses(per_row[0], paired & (labels != -100).any(dim=1))
        return loss

    def _text_mlm(self, passes: ModelPasses, inputs: ModelInputs, masks: Masks, row_losses: dict[str, RowLosses]
                  ) -> torch.Tensor:
        """MLM on the text tower alone, on text-only rows (and image-text rows with text_mlm_paired).

        The tower runs on those rows only, or on one dummy row whose labels are all ignored, so
        every rank runs the same modules whatever its batch holds."""
        applies = self._text_mlm_rows(inputs)
        masked, labels = masks.text_mlm
        index, n = _present_rows(applies)
        if n:
            masked, mask, labels = masked[index], inputs.attention_mask[index], labels[index]
        else:
            masked, mask, labels = masked[:1], torch.ones_like(inputs.attention_mask[:1]), labels[:1]
        weights = None if inputs.row_weights is None else (inputs.row_weights[index] if n else inputs.row_weights[:1])
        per_row: list = []
        loss = mlm_loss(passes.text_mlm_logits(masked, mask), labels, weights, per_row, _denominator(inputs, "text_mlm"))
        picked = _scatter((labels != -100).any(dim=1).float(), index, n, len(inputs)) > 0
        row_losses["text_mlm"] = RowLosses(_scatter(per_row[0], index, n, len(inputs)), picked)
        return loss

    def _image_mim(self, passes: ModelPasses, inputs: ModelInputs, masks: Masks, row_losses: dict[str, RowLosses]
                   ) -> torch.Tensor:
        """SimMIM on the vision tower, on image-only rows (and image-text rows with image_mim_paired):
        ``mim_ratio`` of each image's patches enter as the mask token and a linear head regresses
        their pixels. The encoder sees every patch position (masked or not), so its shapes do not
        depend on the mask and every rank runs the same graph; MAE's dropping of masked patches
        would save compute but make the vision tower's token count a per-row, per-rank variable."""
        applies = self._mim_rows(inputs)
        index, n = _present_rows(applies)
        images = inputs.images.kept(None).unpacked()  # every patch, one image per row
        images = images.index_select(0, index) if n else images.dummy()
        # the dummy row: nothing to predict
        patch_mask = masks.image_mim.index_select(0, index) if n else torch.zeros_like(masks.image_mim[:1])
        prediction = passes.mim_prediction(images, patch_mask)
        weights = None if inputs.row_weights is None or not n else inputs.row_weights[index]
        per_row: list = []
        target = images.patches(self.spec.patch_size)
        loss = mim_loss(prediction, target, patch_mask, weights, per_row, _denominator(inputs, "image_mim"))
        row_losses["image_mim"] = RowLosses(_scatter(per_row[0], index, n, len(inputs)), applies)
        return loss

    # -- captioning ----------------------------------------------------------------------------

    @staticmethod
    def caption_labels(inputs: ModelInputs) -> torch.Tensor:
        """[B, L - 1] each caption's next tokens (its ids from position 1 on: position 0 is the
        tokenizer's start token), -100 past its end and on rows without text."""
        real = inputs.attention_mask[:, 1:].bool() & inputs.has_text[:, None]
        return inputs.input_ids[:, 1:].masked_fill(~real, -100)

    def _caption(self, passes: ModelPasses, enc: Encoded, inputs: ModelInputs, row_losses: dict[str, RowLosses]
                 ) -> torch.Tensor:
        """Next-token cross-entropy of the decoder on every row with text: reading its image on an
        image-text row, as a plain language model on a text-only row. Image-only rows have nothing
        to predict; the decoder still runs over every row, so every rank runs the same graph."""
        labels = self.caption_labels(inputs)
        decoder_inputs = (enc.text_tokens, inputs.attention_mask, enc.image_tokens, inputs.has_image)
        if self.caption_chunk:  # never the [B, L, V] logits
            out = passes.caption_readout(*decoder_inputs)
            ce = chunked_cross_entropy(out.hidden[:, :-1], out.weight, out.bias, labels, self.caption_label_smoothing,
                                       self.caption_chunk).flatten()
        else:
            ce = token_cross_entropy(passes.caption_logits(*decoder_inputs)[:, :-1], labels, self.caption_label_smoothing)
        per_row: list = []
        loss = token_mean(ce, labels, inputs.row_weights, per_row, _denominator(inputs, "caption"))
        row_losses["caption"] = RowLosses(per_row[0], (labels != -100).any(dim=1))
        return loss

    # -- a step's denominators -----------------------------------------------------------------

    def draw(self, inputs: ModelInputs) -> Masks:
        """The keyed MLM, text MLM and MIM masks of one micro-batch (of its present rows), for the
        objectives that are on: what :meth:`local_totals` counts and :meth:`score` scores with."""
        inputs = inputs.present()
        on = self.loss_weights
        return Masks(
            mlm=self._mask(inputs, inputs.has_image & inputs.has_text) if "mlm" in on else None,
            text_mlm=self._mask(inputs, self._text_mlm_rows(inputs), text_tower=True) if "text_mlm" in on else None,
            image_mim=self._patch_mask(inputs) if "image_mim" in on else None,
            views=self.selfdist.draw(inputs) if self.selfdist is not None else None,
        )

    def patch_keep(self, inputs: ModelInputs) -> torch.Tensor | None:
        """Patch dropout's kept patches of each row in a training step (``inputs.key``), keyed by
        (seed, step, sample id, patch): :func:`kept_patches`. None outside training, with the
        dropout off, and after ``patch_dropout_until``."""
        key = inputs.key
        if key is None or self.kept_patch_count(key.step) is None:
            return None
        images = inputs.images
        draw = key.uniform(Stream.PATCH_KEEP, inputs.ids, images.positions(self.spec.patch_size))
        return kept_patches(draw, images.real, self.patch_dropout)

    def kept_patch_count(self, step: int) -> int | None:
        """How many of a square image's patches the tower sees in training step ``step`` (0-based)
        under patch dropout: N - floor(fraction * N). None: every patch (dropout off, or past
        ``patch_dropout_until``)."""
        if not self.patch_dropout or 0 < self.patch_dropout_until <= step:
            return None
        n = self.spec.num_patches
        return n - math.floor(self.patch_dropout * n)

    def local_totals(self, micro: list[ModelInputs]) -> torch.Tensor:
        """What each of :attr:`averaged` divides by, summed over this rank's micro-batches of a step
        ([len(averaged)] fp32): weighted ITM pairs, MLM tokens, MIM patches, caption tokens. The trainer sums it
        over the ranks, so every objective is a mean over the global batch, whatever the split.
        Counts the masks the micro-batches carry (:meth:`draw`), the ones they are scored with."""
        totals = []
        for name in self.averaged:
            total = torch.zeros((), device=micro[0].ids.device)
            for m in micro:
                masks = m.masks if m.masks is not None else self.draw(m)
                m = m.present()
                w = torch.ones_like(m.ids, dtype=torch.float32) if m.row_weights is None else m.row_weights.float()
                if self.locca is not None and name in LOCCA_TASKS:
                    total = total + self.locca.totals(m, w)[name]
                elif name == "itm":
                    total = total + self._itm_total(m, w)
                elif name in ("silc", "tips"):  # weighted (row, local view) pairs, weighted masked patches
                    total = total + self.selfdist.totals(masks.views)[name]
                elif name in ("mlm", "text_mlm", "caption"):
                    labels = self.caption_labels(m) if name == "caption" else (
                        masks.mlm if name == "mlm" else masks.text_mlm)[1]
                    total = total + ((labels != -100).float() * w[:, None]).sum()
                else:
                    patches = masks.image_mim.float().sum(dim=1)
                    total = total + (patches * w * self._mim_rows(m).float()).sum()
            totals.append(total)
        return torch.stack(totals) if totals else torch.zeros(0, device=micro[0].ids.device)

    # -- all of them --------------------------------------------------------------------------

    def score(self, passes: ModelPasses, enc: Encoded, inputs: ModelInputs, contrastive: bool = True
              ) -> ObjectiveOutput:
        """Every objective on one micro-batch, given what the model encoded and the passes it offers
        (in this order: each pass runs where its objective is scored, so the graph, and the order
        its gradients are summed in, is the same whichever objectives are on);
        ``contrastive=False`` leaves out ITC and SigLIP (computed elsewhere, over the cached global
        batch) but keeps their parameters in the graph, as does a model that trains none of them
        (a captioner)."""
        anchor = enc.anchor
        inputs = inputs.present()
        masks = inputs.masks if inputs.masks is not None else self.draw(inputs)
        losses: dict[str, torch.Tensor] = {}
        rows: dict[str, RowLosses] = {}
        if contrastive and any(k in self.loss_weights for k in self.CONTRASTIVE):
            losses.update(self.contrastive_losses(enc.image_embeds, enc.text_embeds, inputs.rows(), passes.logit_scale,
                                                  passes.logit_bias, rows))
        else:  # the temperature in the graph all the same: every parameter gets a gradient
            anchor = anchor + 0.0 * passes.logit_scale
            if passes.logit_bias is not None:
                anchor = anchor + 0.0 * passes.logit_bias
        itm_logits = None
        if "itm" in self.loss_weights:
            losses["itm"], itm_logits = self._itm(passes, enc, inputs, rows)
        if "mlm" in self.loss_weights:
            losses["mlm"] = self._mlm(passes, enc, inputs, masks, rows)
        if "text_mlm" in self.loss_weights:
            losses["text_mlm"] = self._text_mlm(passes, inputs, masks, rows)
        if "image_mim" in self.loss_weights:
            losses["image_mim"] = self._image_mim(passes, inputs, masks, rows)
        if self.locca is not None:
            losses |= self.locca.score(passes, enc, inputs, {k: _denominator(inputs, k) for k in LOCCA_TASKS}, rows)
        elif "caption" in self.loss_weights:
            losses["caption"] = self._caption(passes, enc, inputs, rows)
        if self.selfdist is not None:
            losses |= self.selfdist.score(passes, masks.views, {k: _denominator(inputs, k) for k in ("silc", "tips")},
                                          rows, len(inputs))
        elif "selfdist" in self.spec.heads:  # the heads wait for their stage, in the graph all the same
            anchor = anchor + passes.selfdist_anchor()
        total = anchor + sum(self.loss_weights[k] * v for k, v in losses.items())
        return ObjectiveOutput(
            total, losses, enc.image_embeds, enc.text_embeds, scale_of(passes.logit_scale).detach(), itm_logits, rows
        )

