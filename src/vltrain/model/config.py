"""Config of the model: a preset name plus the overrides a user may want of it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vltrain.errors import ConfigError
from vltrain.model.presets import PRESETS, Architecture, list_presets, locca_decoder
from vltrain.model.text import POOLINGS, TEXT_LAYOUTS
from vltrain.types import Settings


@dataclass
class TextConfig(Settings):
    hf_path: str = ""
    """A local Hugging Face encoder folder (needs the `hf` extra); its tokenizer.json is used."""
    pooling: str = ""
    """first | eos | mean; empty: the preset's choice (last, for a SigLIP checkpoint's fixed-length text)."""
    layout: str = "auto"
    """auto | packed | padded: our own text tower runs its projections and MLPs over the text tokens
    alone, packed, instead of over the batch padded to its longest caption; auto: on a CPU, when
    that skips a fifth of the positions (``vltrain.model.text.packed_tokens``)."""
    pack_multiple: int = 1
    """Packed, round the batch's token count up to a multiple of this (padding positions fill the
    rest, their results dropped): a run's text matrices then take a few sizes rather than a new
    one per batch. 1: the text tokens alone."""
    stretch_keep: int = 20
    """With ``model.init`` of a CLIP checkpoint and ``data.max_text_length`` above its context (77),
    the checkpoint's text position table is stretched to that length (Long-CLIP): its first this
    many rows are kept as they are, so a caption of at most this many tokens embeds as the
    checkpoint embeds it, and the others are interpolated between the old rows
    (``vltrain.model.interop.stretch``). Must be below the checkpoint's context."""


@dataclass
class VisionSettings(Settings):
    patch_dropout: float = 0.0
    """Patch dropout (FLIP): the fraction of each image's patches dropped in a training step, in
    [0, 1); the tower runs on the rest. Drawn per sample and step (the same on any number of ranks
    and after a resume); evaluation, embed and export see every patch. Square images and images at
    their own shape, padded or packed (packed sequences shorten to the kept patches). Masked image
    modelling's own pass keeps every position."""
    patch_dropout_until: int = 0
    """The last step that drops patches; every patch from the next one on (FLIP's unmasked tuning).
    0: patch dropout on every step."""

    def validate(self) -> None:
        if not 0.0 <= self.patch_dropout < 1.0:
            raise ConfigError(f"model.vision.patch_dropout must be in [0, 1) (the fraction of patches "
                              f"dropped), got {self.patch_dropout}")
        if self.patch_dropout_until < 0:
            raise ConfigError(f"model.vision.patch_dropout_until must be >= 0 (0: every step), "
                              f"got {self.patch_dropout_until}")


@dataclass
class TeacherSettings(Settings):
    path: str = ""
    """Distil from this model: anything ``vltrain eval`` opens (a vltrain run, checkpoint or export, a
    Hugging Face CLIP, SigLIP or SigLIP 2 folder, an OpenCLIP file, or either by its Hub name,
    hf-hub:ORG/NAME[@REVISION], saved pinned to its commit). Frozen, in eval mode, run without
    autograd under train.precision, on its own preprocessing of the same decoded image and its own
    tokenizer. Empty: no teacher. Its losses: model.loss.distill and model.loss.distill_sigmoid."""
    precomputed: bool = False
    """Read the teacher's embeddings that ``vltrain data teacher-embed`` stored beside each training
    source's sample index, instead of running the teacher: no teacher runs in training."""


@dataclass
class LossConfig(Settings):
    """Per-objective weights. An objective the model has no head for (ITM or MLM on a dual encoder)
    is ignored, so one loss section serves every preset."""

    itc: float = 1.0
    """Weight of the CLIP contrastive loss (0: off)."""
    siglip: float = 0.0
    """Weight of the SigLIP sigmoid loss (0: off); itc or siglip must be > 0."""
    itm: float = 1.0
    """Weight of image-text matching with hard negatives (fusion presets only)."""
    mlm: float = 0.0
    """Weight of masked language modelling through the fusion encoder (fusion presets; needs a tokenizer with a mask
    token)."""
    mlm_probability: float = 0.15
    """Fraction of real tokens picked for MLM (80% masked, 10% random, 10% kept)."""
    siglip_bias: bool = True
    """Learnable logit bias for SigLIP (initialized at -10, with logit_scale at ln 10)."""
    contrastive_impl: str = "gather"
    """How ITC and SigLIP reach the other ranks' columns: gather (all at once: a [b, W*b] matrix per
    rank) or ring (block by block around the ranks: memory flat in W, the same values; vltrain.objectives.ring)."""
    itm_negatives: str = "auto"
    """Where ITM draws its hard negatives: group (a fixed run of itm_group_size consecutive rows of the
    global batch: the same pools on any number of ranks), local (the rank's own micro-batch, as
    ALBEF), global (every rank's micro-batch: gathers every rank's token features, W times the
    bytes); auto: group with data.global_batch_size, local without (docs/distributed.md)."""
    itm_group_size: int = 0
    """Rows per ITM group (itm_negatives: group); it must divide the micro-batch. 0: with
    data.global_batch_size, its largest divisor up to about its square root (at most 64), the same
    on any split; without, the micro-batch's largest divisor up to 64. Kept by the run's checkpoints."""
    text_mlm: float = 0.0
    """Masked language modelling on the text tower alone (its own head, tied to the token embedding):
    what text-only rows train. Any preset; needs a tokenizer with a mask token."""
    text_mlm_paired: bool = False
    """text_mlm on image-text rows too (by default only text-only rows)."""
    image_mim: float = 0.0
    """Masked image modelling on the vision tower (SimMIM: masked patches are replaced by a learned
    token, a linear head regresses their pixels): what image-only rows train."""
    image_mim_paired: bool = False
    """image_mim on image-text rows too (by default only image-only rows)."""
    mim_ratio: float = 0.6
    """The share of an image's patches image_mim masks."""
    caption: float = 2.0
    """Weight of the captioning loss (presets with a decoder: tiny-coca, tiny-coca-lite, coca-vit-b32;
    ignored without one; 0: no decoder): next-token cross-entropy of the decoder reading the image tokens,
    on image-text rows, and as a plain language model on text-only rows. 2: OpenCLIP's CoCa default."""
    caption_label_smoothing: float = 0.0
    """Label smoothing of the captioning loss, in [0, 1)."""
    referring: float = 1.0
    """Weight of LocCa's referring expressions (presets with a LocCa decoder: tiny-siglip2,
    siglip2-vit-b16; ignored without one): a region's phrase in, its box out as four box tokens,
    on the rows whose images carry regions (docs/formats.md#regions)."""
    grounded_caption: float = 1.0
    """Weight of LocCa's grounded captions (presets with a LocCa decoder): a region's box in, its
    phrase out, on the rows whose images carry regions."""
    parallel_prediction: float = 0.5
    """The probability that a LocCa task of a row is decoded in parallel (CapPa: every target token
    from a mask token at once, no causal mask) instead of causally; drawn per row, task and step.
    SigLIP 2: 0.5."""
    caption_chunk: int = 0
    """Make the captioning loss's logits (and LocCa's tasks') this many labelled tokens at a time, in
    the forward and again in the backward (vltrain.objectives.chunked), never the whole [tokens x
    vocabulary] tensor: for large vocabularies (SigLIP 2's 256k), at the cost of one more vocabulary
    matmul per token (docs/benchmarks/memory.md#the-captioning-loss-over-a-256k-vocabulary-in-chunks).
    The same loss to fp32's rounding, its matmuls in fp32 even under bf16. 0: all the logits at once."""
    distill: float = 0.0
    """Weight of distillation from model.teacher (OpenCLIP's DistillClipLoss): the cross-entropy of the
    student's image-to-text and text-to-image softmaxes over the global batch against the teacher's."""
    distill_sigmoid: float = 0.0
    """Weight of sigmoid distillation from model.teacher, for SigLIP students: each pair's sigmoid
    cross-entropy against the teacher's probability of a match (vltrain.objectives.distill)."""
    silc: float = 0.0
    """Weight of SILC self-distillation (SigLIP 2: 1 x a per-size factor): the student's local views
    against the EMA teacher's global view, through a prototype head (model.selfdist). Reads the
    teacher, so it is turned on by the train.stages entry that turns the teacher on, never at step 0."""
    tips: float = 0.0
    """Weight of TIPS masked prediction (SigLIP 2: 0.25 x a per-size factor): the student's masked
    patches of the global view against the EMA teacher's patches there. Turned on by a stage, as silc."""

    @property
    def contrastive(self) -> bool:
        """Whether an objective over the global batch's embeddings is on (itc, siglip, distillation)."""
        return bool(self.itc or self.siglip or self.distill or self.distill_sigmoid)

    def validate(self) -> None:
        for name in ("itc", "siglip", "itm", "mlm", "text_mlm", "image_mim", "caption", "referring", "grounded_caption",
                     "distill", "distill_sigmoid", "silc", "tips"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.loss.{name} must be >= 0, got {getattr(self, name)}")
        if (self.distill or self.distill_sigmoid) and self.contrastive_impl == "ring":
            raise ConfigError("model.loss.distill and distill_sigmoid gather the global batch: use "
                              "model.loss.contrastive_impl: gather")
        if self.contrastive_impl not in ("gather", "ring"):
            raise ConfigError(f"model.loss.contrastive_impl must be gather or ring, got {self.contrastive_impl!r}")
        if self.itm_negatives not in ("auto", "group", "local", "global"):
            raise ConfigError(f"model.loss.itm_negatives must be auto, group, local or global, got {self.itm_negatives!r}")
        if self.itm_group_size < 0:
            raise ConfigError(f"model.loss.itm_group_size must be >= 0 (0: automatic), got {self.itm_group_size}")
        if not 0 < self.mim_ratio < 1:
            raise ConfigError(f"model.loss.mim_ratio must be in (0, 1), got {self.mim_ratio}")
        if not 0 <= self.caption_label_smoothing < 1:
            raise ConfigError(f"model.loss.caption_label_smoothing must be in [0, 1), got {self.caption_label_smoothing}")
        if not 0 <= self.parallel_prediction <= 1:
            raise ConfigError(f"model.loss.parallel_prediction must be in [0, 1], got {self.parallel_prediction}")
        if self.caption_chunk < 0:
            raise ConfigError(f"model.loss.caption_chunk must be >= 0 (tokens per chunk; 0: no chunks), "
                              f"got {self.caption_chunk}")
        if not 0 < self.mlm_probability < 1:
            raise ConfigError(f"model.loss.mlm_probability must be in (0, 1), got {self.mlm_probability}")


@dataclass
class SelfDistSettings(Settings):
    """SigLIP 2's self-distillation (model.loss.silc) and masked prediction (model.loss.tips): the
    views, the prototype heads and the temperatures (docs/objectives.md#self-distillation-silc-and-masked-prediction-tips)."""

    local_views: int = 8
    """Local views per image (SigLIP 2: 8)."""
    local_size: int = 0
    """Their side in pixels, a multiple of the patch size (0: 3/7 of the image size, rounded to whole
    patches: 96 px at 224)."""
    local_scale: list[float] = field(default_factory=lambda: [0.05, 0.4])
    """The share of the image's area a local view covers, drawn uniformly in this range."""
    global_scale: list[float] = field(default_factory=lambda: [0.4, 1.0])
    """The same for the global view, which has the model's image size."""
    mask_ratio: float = 0.5
    """The share of the global view's patches the student sees as the mask token (TIPS; SigLIP 2: 0.5)."""
    prototypes: int = 8192
    """K, the prototypes of each head (iBOT's ViT-B/16 count; SigLIP 2 gives none)."""
    hidden: int = 2048
    """The width of each head's MLP (DINO's)."""
    bottleneck: int = 256
    """The width the MLP ends in, L2-normalized before the prototypes (DINO's)."""
    student_temperature: float = 0.1
    """The student's softmax temperature (DINO's, SILC's)."""
    teacher_temperature: float = 0.04
    """The teacher's, lower: it sharpens the targets (DINO's starting value)."""
    centre_momentum: float = 0.9
    """How much of the teacher's centre a step keeps (DINO's center_momentum)."""
    heads: bool = False
    """Whether the model has the heads: decided (train.stages turn silc or tips on), not set by hand."""

    def validate(self) -> None:
        ranges = {"local_scale": self.local_scale, "global_scale": self.global_scale}
        for key, (lo, hi) in ((k, v if len(v) == 2 else (0.0, -1.0)) for k, v in ranges.items()):
            if not 0.0 < lo <= hi <= 1.0:
                raise ConfigError(f"model.selfdist.{key} must be two numbers 0 < min <= max <= 1, got {ranges[key]}")
        if self.local_views < 1 or self.local_size < 0 or min(self.prototypes, self.hidden, self.bottleneck) < 1:
            raise ConfigError("model.selfdist: local_views, prototypes, hidden and bottleneck must be >= 1 and "
                              "local_size >= 0 (0: 3/7 of the image size)")
        if not 0.0 < self.mask_ratio < 1.0 or not 0.0 <= self.centre_momentum < 1.0:
            raise ConfigError("model.selfdist: mask_ratio must lie in (0, 1) and centre_momentum in [0, 1)")
        if min(self.student_temperature, self.teacher_temperature) <= 0:
            raise ConfigError("model.selfdist: the temperatures must be > 0")


@dataclass
class ModelConfig(Settings):
    preset: str = "tiny-clip"
    """A name from ``vltrain.model.list_presets()`` (tiny-clip, tiny-albef, clip-vit-b32, ...); empty
    in a run's saved config when model.init gave the architecture (model.arch)."""
    text: TextConfig = field(default_factory=TextConfig)
    vision: VisionSettings = field(default_factory=VisionSettings)
    loss: LossConfig = field(default_factory=LossConfig)
    teacher: TeacherSettings = field(default_factory=TeacherSettings)
    selfdist: SelfDistSettings = field(default_factory=SelfDistSettings)
    embed_dim: int = 0
    """0: the preset's."""
    init: str = ""
    """Start from pretrained weights: a Hugging Face CLIPModel/SiglipModel/Siglip2Model folder, a
    Hugging Face BlipForConditionalGeneration or BlipForImageTextRetrieval folder, or an OpenCLIP
    checkpoint file or CoCa folder; or either by its Hub name, hf-hub:ORG/NAME[@REVISION] (a branch,
    tag or commit sha), which the saved config pins to its commit (hf-hub:ORG/NAME@SHA). Empty:
    random initialization from the seed."""
    quick_gelu: bool = False
    """An OpenCLIP checkpoint of OpenAI's weights (or one trained as ``*-quickgelu``) needs QuickGELU;
    tensor shapes cannot tell. A Hugging Face folder says so in its config.json."""
    locca: bool = False
    """Add LocCa's decoder (``vltrain.model.presets.locca_decoder``: half the text tower's depth,
    1,000 box tokens) to an architecture without one: a SigLIP 2 checkpoint of model.init, whose
    released weights carry no decoder, trains with one that starts fresh. The siglip2 presets have it."""
    arch: dict[str, Any] = field(default_factory=dict)
    """The architecture ``model.init`` describes, filled in from the checkpoint so that the run's
    saved config rebuilds the model without it; leave it out of configs."""

    def architecture(self) -> Architecture:
        """The preset's architecture, or ``model.arch`` (the one ``model.init`` read from its checkpoint)."""
        if self.arch:
            return self._with_locca(Architecture.from_dict(self.arch))
        if self.preset not in PRESETS:
            raise ConfigError(f"model.preset: unknown preset {self.preset!r}; choose one of {', '.join(list_presets())}"
                              + (" (or leave it out with model.init)" if self.init else ""))
        return self._with_locca(PRESETS[self.preset]())

    def _with_locca(self, arch: Architecture) -> Architecture:
        if self.locca and arch.decoder is None:
            arch.decoder = locca_decoder(arch.text)
        elif self.locca and not arch.decoder.standalone:
            raise ConfigError(f"model.locca: {self.preset or 'this architecture'} has a captioning decoder over its "
                              "text tower already; LocCa's is for a model without one (a SigLIP 2 checkpoint)")
        return arch

    def check_objectives(self) -> None:
        """A model needs a contrastive objective, unless it captions (a decoder with the caption loss
        on: a BLIP captioner from model.init). Said once the architecture is known: with model.init,
        once it is read."""
        if self.loss.contrastive or (self.init and not self.arch):
            return
        if self.loss.caption == 0 or self.architecture().decoder is None:
            raise ConfigError("model.loss: set itc, siglip, distill or distill_sigmoid > 0 (a model needs a "
                              "contrastive objective, unless it captions: a captioning decoder with "
                              "model.loss.caption > 0)")

    def validate(self) -> None:
        if self.preset not in list_presets() and not (self.preset == "" and (self.arch or self.init)):
            raise ConfigError(f"model.preset: unknown preset {self.preset!r}; choose one of {', '.join(list_presets())}")
        if self.text.pooling not in ("", *POOLINGS):
            raise ConfigError(
                f"model.text.pooling must be {', '.join(POOLINGS[:-1])} or {POOLINGS[-1]}, got {self.text.pooling!r}"
            )
        if self.text.layout not in TEXT_LAYOUTS:
            raise ConfigError(f"model.text.layout must be {', '.join(TEXT_LAYOUTS)}, got {self.text.layout!r}")
        if self.text.pack_multiple < 1:
            raise ConfigError(f"model.text.pack_multiple must be 1 or more, got {self.text.pack_multiple}")
        if self.text.stretch_keep < 0:
            raise ConfigError(f"model.text.stretch_keep must be 0 or more (the text positions a stretched table "
                              f"keeps as they are; Long-CLIP: 20), got {self.text.stretch_keep}")
        if self.embed_dim < 0:
            raise ConfigError(f"model.embed_dim must be >= 0, got {self.embed_dim}")
        distilling = self.loss.distill or self.loss.distill_sigmoid
        if distilling and not self.teacher.path:
            raise ConfigError("model.loss.distill and distill_sigmoid need a teacher: set model.teacher.path to a "
                              "run, checkpoint, export, Hugging Face folder or OpenCLIP file")
        if self.teacher.precomputed and not self.teacher.path:
            raise ConfigError("model.teacher.precomputed=true reads a teacher's stored embeddings, but "
                              "model.teacher.path names no teacher: set it to the teacher they were made with, "
                              "or drop model.teacher.precomputed")
        if self.teacher.path and not distilling:
            raise ConfigError(f"model.teacher.path {self.teacher.path} is set but no loss uses it: set "
                              "model.loss.distill (or distill_sigmoid, for a SigLIP student) > 0, or drop the teacher")
        self.check_objectives()
