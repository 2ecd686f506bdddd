"""What every layer passes on: one micro-batch as the model takes it (:class:`ModelInputs`, its images
one :class:`~vltrain.images.Images`), the rows the objectives weigh (:class:`Rows`), what the
model's ``encode`` returns (:class:`Encoded`; image tokens as :class:`Tokens`, with their mask),
what the objectives know of a model
(:class:`ModelSpec`) and the passes they ask of it (:class:`ModelPasses`), and what the trainer
asks of a model besides encoding (:class:`TrainableModel`).

They sit below the code that makes them (the loader, the model) so that a consumer (the objectives,
the step, gradient caching) never imports a producer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from vltrain.images import Images


@dataclass
class ModelInputs:
    """One micro-batch as the model and the objectives take it: on the device, pixels normalized."""

    images: Images
    """The images in their layout (square, at their own shape padded or packed, with the patches
    patch dropout keeps): zeros where a row has none."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    has_image: torch.Tensor
    has_text: torch.Tensor
    ids: torch.Tensor
    """int64 [B] sample ids: a column with the row's id is never a negative."""
    row_weights: torch.Tensor | None = None
    """float [B] per-row weights in every objective (None: all 1); a row of weight 0 is absent."""
    source: torch.Tensor | None = None
    """int64 [B] the index of each row's source in ``data.train`` (for per-source metrics)."""
    counts: tuple[int, int] | None = None
    """How many rows have an image and how many have text, known on the host (the collator counts
    them): the model splits rows between its towers without asking the device (None: it asks)."""
    key: Any = None
    """A ``vltrain.objectives.keyed.StepKey`` (typed loosely: the objectives sit above this layer): the
    step's seed, number and objective denominators, what the objectives' random draws are keyed by
    and what their losses are divided by (None: fixed draws, local denominators)."""
    masks: Any = None
    """A ``vltrain.objectives.scoring.Masks`` (typed loosely, as ``key``): this micro-batch's MLM and
    MIM masks, drawn once a step and both counted for the denominators and scored (None: drawn
    when scored)."""
    teacher_view: "TeacherView | None" = None
    """The same rows as the teacher of distillation takes them (its image size, statistics and
    tokenizer), for a teacher that runs in training; None otherwise."""
    teacher: "TeacherEmbeds | None" = None
    """The teacher's embeddings of these rows: read from stored ones by the loader, or computed from
    ``teacher_view`` before the step's forward. None: no distillation."""
    region_ids: torch.Tensor | None = None
    """int64 [B, R, Lr]: the phrases of each image's regions (their boxes: ``images.boxes``, which
    ``images.box_mask`` says are real), tokenized as captions, padded with the pad id. None when no
    row of the batch keeps a region; R and Lr differ between ranks and batches."""
    region_attention_mask: torch.Tensor | None = None
    """int64 [B, R, Lr]: 1 on each phrase's tokens (with ``region_ids``)."""

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def rows(self) -> "Rows":
        return Rows(self.has_image, self.has_text, self.ids, self.row_weights, self.source, self.teacher)

    def present(self) -> "ModelInputs":
        """Rows of weight 0 as if they had neither side: no objective sees them, not even as a negative."""
        rows = self.rows().present()
        return replace(self, has_image=rows.has_image, has_text=rows.has_text, counts=None)


@dataclass
class Rows:
    """What the contrastive objectives need of a batch besides the embeddings: which rows have both
    sides, their ids and weights."""

    has_image: torch.Tensor
    has_text: torch.Tensor
    ids: torch.Tensor
    row_weights: torch.Tensor | None = None
    source: torch.Tensor | None = None
    teacher: "TeacherEmbeds | None" = None
    """The teacher's embeddings of these rows (distillation, ``model.teacher``); None: no teacher."""

    def present(self) -> "Rows":
        """Rows of weight 0 as if they had neither side."""
        if self.row_weights is None:
            return self
        keep = self.row_weights > 0
        return replace(self, has_image=self.has_image & keep, has_text=self.has_text & keep)

    @staticmethod
    def cat(parts: list["Rows"]) -> "Rows":
        """Row-wise concatenation (the micro-batches of one step, for gradient caching)."""
        def cat(name: str) -> torch.Tensor | None:
            first = getattr(parts[0], name)
            return None if first is None else torch.cat([getattr(p, name) for p in parts])

        teacher = None if parts[0].teacher is None else TeacherEmbeds.cat([p.teacher for p in parts])
        return Rows(cat("has_image"), cat("has_text"), cat("ids"), cat("row_weights"), cat("source"), teacher)


@dataclass
class RowLosses:
    """One objective's loss on each row of a batch (detached), and the rows it applies to."""

    values: torch.Tensor
    applies: torch.Tensor


@dataclass
class TeacherView:
    """A micro-batch as a distillation teacher takes it: images at its own size (or shape), normalized
    with its statistics, and captions in its tokenizer's ids (zeros and padding where a row lacks a side)."""

    images: Images
    """Square [B, 3, T, T], or a teacher at native shape: padded, one image per row."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor


@dataclass
class TeacherEmbeds:
    """What distillation needs of a teacher for a batch's rows: its embeddings, run live or read from
    the ones ``vltrain data teacher-embed`` stored, and its temperature (and SigLIP bias)."""

    image: torch.Tensor
    """[B, Dt] fp32, L2-normalized; zeros where the row has no image. Dt need not be the student's D."""
    text: torch.Tensor
    """[B, Dt] fp32, L2-normalized; zeros where the row has no text."""
    scale: torch.Tensor
    """0-dim fp32: the teacher's inverse temperature, exp(logit_scale) (not its log)."""
    bias: torch.Tensor | None = None
    """0-dim fp32: the teacher's SigLIP logit bias, if it has one."""

    @staticmethod
    def cat(parts: list["TeacherEmbeds"]) -> "TeacherEmbeds":
        first = parts[0]
        return TeacherEmbeds(torch.cat([p.image for p in parts]), torch.cat([p.text for p in parts]),
                             first.scale, first.bias)


@dataclass
class Tokens:
    """A tower's tokens and which of them are real, made once by the tower that knows it (the
    vision tower from each image's grid) and carried together from there: the objectives, the
    fusion encoder and evaluation read the same mask and never work it out again.

    ``real`` is None when every token is real (square images): :attr:`mask` is then all true, and
    attention takes :attr:`cross_mask`, None, so the square path runs without a mask, as fast as it
    would with no mask at all. Indexing, :meth:`cat` and :meth:`gathered` keep that form."""

    values: torch.Tensor
    """[B, N, W]"""
    real: torch.Tensor | None = None
    """bool [B, N]: the real tokens, where some are not (images at their own shape, padded)."""

    @property
    def mask(self) -> torch.Tensor:
        """bool [B, N]: which tokens are real; never None."""
        if self.real is not None:
            return self.real
        return torch.ones(self.values.shape[:2], dtype=torch.bool, device=self.values.device)

    @property
    def cross_mask(self) -> torch.Tensor | None:
        """What cross-attention to these tokens takes, [B, 1, 1, N] (bool), or None when every token is real."""
        return None if self.real is None else self.real[:, None, None, :]

    def __len__(self) -> int:
        return int(self.values.shape[0])

    def __getitem__(self, rows) -> "Tokens":
        """The tokens of some rows (an index, a bool mask or a slice over dim 0)."""
        return Tokens(self.values[rows], None if self.real is None else self.real[rows])

    def index_select(self, index: torch.Tensor) -> "Tokens":
        real = None if self.real is None else self.real.index_select(0, index)
        return Tokens(self.values.index_select(0, index), real)

    @staticmethod
    def cat(parts: list["Tokens"]) -> "Tokens":
        """Row-wise concatenation; all-real only when every part is."""
        values = torch.cat([p.values for p in parts])
        if all(p.real is None for p in parts):
            return Tokens(values)
        return Tokens(values, torch.cat([p.mask for p in parts]))


@dataclass
class Encoded:
    image_embeds: torch.Tensor
    """[B, D] L2-normalized; zero rows where there is no image."""
    text_embeds: torch.Tensor
    """[B, D] L2-normalized; zero rows where there is no text."""
    image_tokens: Tokens | None
    """[B, N, Wv] the vision tower's tokens and which are real (fusion and captioning models only);
    zeros where there is no image (with a mask, only the first of them counts as real: attention
    needs one key)."""
    text_tokens: torch.Tensor | None
    """[B, L, Wt] the text tower's tokens (fusion and captioning models only); zeros where there is no text."""
    anchor: torch.Tensor
    """A zero scalar connected to every parameter ``encode`` used."""


@dataclass
class Readout:
    """The decoder's logits unmade: the states the map to the vocabulary reads and that map,
    ``logits = hidden @ weight.T + bias``. What a loss takes that makes the logits a chunk of tokens
    at a time, never all of them at once (:mod:`vltrain.objectives.chunked`)."""

    hidden: torch.Tensor
    """[B, L, W] after the decoder's final norm (and BERT's transform)."""
    weight: torch.Tensor
    """[V, W] the map to the vocabulary (the token embedding, when tied)."""
    bias: torch.Tensor | None = None
    """[V] the per-token bias of BERT's transform head; None without one."""


@dataclass(frozen=True)
class ModelSpec:
    """What the objectives know of a model, fixed when it is built (``VLModel.spec``): which heads it
    has, hence which objectives can run, and the facts their draws and targets need."""

    heads: frozenset[str]
    """The objectives beyond the contrastive ones that the model has a head for: a subset of itm,
    mlm, text_mlm, image_mim, caption."""
    vocab_size: int
    pad_id: int
    mask_id: int | None
    """The tokenizer's mask token (MLM), if it has one."""
    patch_size: int
    num_patches: int
    """Patches of a square image (``data.image_size``)."""
    box_bins: int = 0
    """A LocCa decoder's box tokens (:class:`vltrain.model.locca.LocCaVocab`); 0: no LocCa decoder."""


class ModelPasses(Protocol):
    """The model passes the objectives run, each on inputs the objective itself chose; ``VLModel``
    offers them.

    Why the objectives get these passes and not their results: every one of them runs on something
    only the objective decides. ITM's hard negatives are drawn from the similarity of the encoded
    embeddings, so its fusion pass can only run once they are chosen; MLM and MIM mask with draws
    keyed by the step and the sample; text MLM and MIM pick the rows they apply to (or one dummy
    row, so that every rank runs the same graph). Handing the objectives tensors instead would split
    each objective into a half before its pass and a half after it, with the task threading them,
    and the order of the passes, which sets the order autograd sums gradients in (so the bits of a
    fixed-seed curve), would be kept in a second place. Through this protocol the objectives still
    call no tower, fusion encoder or head themselves and import no model class.
    """

    logit_scale: torch.Tensor
    """The learnable log inverse temperature of ITC and SigLIP."""
    logit_bias: torch.Tensor | None
    """SigLIP's learnable bias (None: no SigLIP bias)."""

    def itm_logits(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens
                   ) -> torch.Tensor:
        """[B, 2] ITM logits of fused (caption, image) pairs; the fusion reads the real image tokens."""

    def mlm_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens) -> torch.Tensor:
        """[B, L, V] MLM logits of (masked) captions re-encoded and fused with their images' tokens."""

    def text_mlm_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B, L, V] MLM logits of (masked) captions from the text tower alone."""

    def locca_logits(self, rows: Any, image_tokens: Tokens, has_image: torch.Tensor) -> torch.Tensor:
        """[N, L, V] a LocCa decoder's logits of ``rows`` (a :class:`vltrain.boxes.TaskRows`),
        reading ``image_tokens`` [N, M, W] where ``has_image``."""

    def locca_readout(self, rows: Any, image_tokens: Tokens, has_image: torch.Tensor) -> "Readout":
        """What :meth:`locca_logits` makes its logits of (``model.loss.caption_chunk``)."""

    def selfdist_logits(self, images: Any, patch_mask: torch.Tensor | None = None, silc: bool = True,
                        tips: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """SILC's [B, K] and TIPS's [B, N, K] prototype logits of ``images`` (an
        :class:`vltrain.images.Images`), ``patch_mask`` entering as the mask token."""

    def selfdist_centres(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The teacher's centres of SILC's and TIPS's logits."""

    def selfdist_anchor(self) -> torch.Tensor:
        """Zero times SILC's and TIPS's heads: in a step's graph where neither loss is scored."""

    def caption_logits(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
                       has_image: torch.Tensor) -> torch.Tensor:
        """[B, L, V] the decoder's next-token logits over the text tower's tokens, reading the image
        tokens in the rows where ``has_image``."""

    def caption_readout(self, text_tokens: torch.Tensor, attention_mask: torch.Tensor, image_tokens: Tokens,
                        has_image: torch.Tensor) -> Readout:
        """What :meth:`caption_logits` makes its logits of, without making them."""

    def mim_prediction(self, images: Images, patch_mask: torch.Tensor) -> torch.Tensor:
        """[B, patches, 3 * p * p] the pixels predicted for each patch of ``images`` (one to a row),
        the masked ones entering as the mask token."""


@runtime_checkable
class TrainableModel(Protocol):
    def flops_per_sample(self, text_len: int | None = None, kept_patches: int | None = None) -> float:
        """Training FLOPs (forward + backward) of one sample whose caption has ``text_len`` tokens,
        its image seen through ``kept_patches`` patches (patch dropout; None: all)."""

    def blocks_for_sharding(self) -> list[nn.Module]:
        """Transformer blocks in forward order: FSDP2 shards (and ``train.compile`` then compiles) each."""

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters that take no weight decay (e.g. ``default_no_weight_decay(self)``)."""

    def layer_ids(self) -> dict[str, tuple[int, int]]:
        """``name -> (layer, top)`` for layer-wise lr decay; a parameter left out is at the top."""

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward instead of keeping them."""


class Settings:
    """A config section (a dataclass) that :func:`freeze` makes read-only.

    A run decides its whole config in one pass (:mod:`vltrain.compose.decide`), saves it, and then
    freezes it: what ``config.yaml`` says is what the run used, since nothing can change it later."""

    _frozen = False

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise AttributeError(f"{type(self).__name__}.{name}: the config is decided and frozen; set it in the "
                                 "config, or decide it in vltrain.compose.decide before the run is built")
        object.__setattr__(self, name, value)


def freeze(settings: Any) -> Any:
    """Make ``settings`` and every section under it (lists of sections included) read-only; returns it."""
    if isinstance(settings, (list, tuple)):
        for item in settings:
            freeze(item)
        return settings
    if not isinstance(settings, Settings):
        return settings
    for value in vars(settings).values():
        freeze(value)
    object.__setattr__(settings, "_frozen", True)
    return settings


def revise(settings: Any, **changes: Any) -> Any:
    """A frozen copy of the section ``settings`` with ``changes``: how a decided config changes."""
    return freeze(replace(settings, **changes))
