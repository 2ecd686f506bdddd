"""Config of the data layer: where samples come from, how they are decoded, batched and checked."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from vltrain.errors import ConfigError
from vltrain.types import Settings, revise

PAD_MULTIPLE = 8
"""The default rounding of padded widths (``DataConfig.pad_multiple``)."""


def padded_width(max_len: int, multiple: int = PAD_MULTIPLE) -> int:
    """Text positions per row of a batch whose longest row has ``max_len`` tokens (at least one)."""
    return max(multiple, -(-max(int(max_len), 1) // multiple) * multiple)


MAX_IMAGE_PIXELS = 89_478_485
"""Decompression-bomb guard: Pillow's own default limit (``PIL.Image.MAX_IMAGE_PIXELS``), the
default of ``data.max_image_pixels``. Here rather than in ``vltrain.data.images`` so that reading
a config (an index build's worker processes do) does not import torch."""


def check_patch_budget(min_patches: int, max_patches: int) -> None:
    """The patch budget's one rule: a grid of at least one patch, within ``max_patches``, reaching
    ``min_patches``. ``DataConfig.validate`` applies it to a config when it is read;
    ``vltrain.data.native.native_grid`` to its own arguments, which a caller may pass without one."""
    if not 1 <= min_patches <= max_patches:
        raise ConfigError(f"data.min_patches ({min_patches}) must be >= 1 and at most data.max_patches "
                          f"({max_patches})")


@dataclass
class SourceSpec(Settings):
    """One source of a mixture: a manifest (.jsonl/.csv/.tsv) or a shard pattern, with a weight."""

    path: str = ""
    weight: float = 1.0
    """Sampling rate per row, relative to the other sources."""
    loss_weight: float = 1.0
    """Scales this source's rows in every objective (0: its rows train nothing)."""
    name: str = ""
    """The name of its metrics (``source/<name>/...``); empty: the file name without extension."""

    def display_name(self) -> str:
        """``name``, else the file name before its extension and any pattern (``train-*.parquet``:
        train), else the folder's name (``shards/{00000..00009}.tar``: shards)."""
        if self.name:
            return self.name
        parts = [p for p in self.path.replace("\\", "/").split("/") if p]
        for part in reversed(parts):
            stem = re.split(r"[{*?\[]", part.split(".", 1)[0], maxsplit=1)[0].rstrip("-_")
            if stem:
                return stem
        return "source"


Sources = Union[str, list[Union[str, SourceSpec]], None]
"""``data.train`` / ``data.val`` as written: a string, a list of strings and mappings, or null."""


def as_specs(value: Any) -> Union[str, list[SourceSpec]]:
    """A source setting with each listed string made a source of its own (weight 1: sampled in
    proportion to its rows, as one source of all the files would be; its own metrics), named
    apart where two would share a name; null is "" (none)."""
    if value is None or isinstance(value, str):
        return value or ""
    specs = [SourceSpec(path=v) if isinstance(v, str) else v for v in value]
    given = [isinstance(v, str) for v in value]
    names = [s.display_name() for s in specs]
    for k, (spec, plain) in enumerate(zip(specs, given)):
        if plain and names.count(names[k]) > 1:
            spec.name = f"{names[k]}-{names[:k + 1].count(names[k])}"
    return specs


@dataclass
class CsvConfig(Settings):
    """Column names and separator for CSV/TSV manifests (OpenCLIP writes filepath/title, tab-separated)."""

    image_key: str = "filepath"
    """Image column of CSV/TSV manifests and parquet files (absent: the aliases image, image_path,
    filepath; for parquet then jpg, jpeg, png, webp, img)."""
    text_key: str = "title"
    """Text column (absent: the aliases text, caption, title)."""
    id_key: str = "id"
    """Id column (absent: ids are derived; parquet tries id, then key)."""
    separator: str = ""
    """Empty: a tab for .tsv files, a comma otherwise."""


@dataclass
class ModalityWeights(Settings):
    """Loss weights of rows by modality, for objectives that accept single-modality rows."""

    image_text: float = 1.0
    """Loss weight of image-text rows."""
    text_only: float = 1.0
    """Loss weight of text-only rows (in `model.loss.text_mlm`)."""
    image_only: float = 1.0
    """Loss weight of image-only rows (in `model.loss.image_mim`)."""


@dataclass(frozen=True)
class ResolvedBatching:
    """What the text padding and the batch budgets are once a config's zeros are resolved.

    The sampler plans budget batches with these and the collator pads with the same multiple, so
    a planned batch is exactly as wide as the one delivered: both take them from here.
    """

    pad_multiple: int
    token_budget: int
    image_budget: int
    patch_budget: int = 0
    """0: no patch budget."""


@dataclass
class DataConfig(Settings):
    train: Sources = ""
    """A manifest, a brace pattern or a glob of tar shards or parquet files, local or remote
    ('shards/{00000..00009}.tar', 'data/train-*.parquet'); or a list of those, and of {path, weight,
    loss_weight, name} mappings: each entry a source of the mixture (docs/formats.md#mixing-sources)."""
    val: Sources = ""
    """Held-out pairs for retrieval recall, same forms as data.train (empty or null: no evaluation)."""
    batch_size: int = 64
    """Per-rank micro-batch (with budget batching: the largest a batch may be). Ignored when
    data.global_batch_size is set."""
    global_batch_size: int = 0
    """Samples per optimizer step, over all ranks: the run's batches and math are then the same on
    any number of ranks, and it resumes on any number (docs/distributed.md#the-global-batch). 0: the
    global batch is data.batch_size x train.accumulation x ranks, tied to the world size."""
    micro_batch_size: int = 0
    """With data.global_batch_size: the most rows one rank runs at once (0: global / ranks); the
    accumulation steps are global / (ranks x micro), with gradcache for the contrastive loss."""
    image_size: int = 224
    """Side of the square images fed to the model; a multiple of the preset's patch size. With
    resize native, the side the position table is made for (it is resized to each image's grid)."""
    resize: Literal["crop", "squash", "native"] = "crop"
    """crop: shorter side to image_size, then center crop; squash: both sides to image_size; native:
    each image at its own aspect ratio, resized to the largest grid of patches within
    data.max_patches (SigLIP 2's NaFlex; docs/formats.md#images-at-their-own-shape)."""
    max_patches: int = 256
    """resize native: the most patches an image becomes (the step's sequence length per image)."""
    max_patches_choices: list[int] = field(default_factory=list)
    """resize native, fixed batching: the patch budget of each optimizer step is drawn from these
    (SigLIP 2's NaFlex stage: [128, 256, 576, 784, 1024]), keyed by train.seed and the step's place
    in the data order, so every rank and micro-batch of a step, on any split of data.global_batch_size
    and after a resume, draws the same; its images are resized within it and its batch padded (or
    packed) to it. Each within [data.min_patches, data.max_patches]; evaluation keeps data.max_patches.
    Empty: every step data.max_patches (docs/formats.md#sequence-lengths-drawn-per-step)."""
    min_patches: int = 1
    """resize native with upscale false: an image smaller than this many patches is enlarged to it."""
    upscale: bool = True
    """resize native: enlarge images smaller than the budget to fill it (SigLIP 2 does); false keeps
    a small image at its own size (rounded up to whole patches), at least data.min_patches."""
    pack_images: bool = False
    """resize native: place several images into each sequence of data.max_patches positions, attention
    kept inside each image, instead of padding every image to max_patches (a tower with a class token
    adds one position per image; docs/formats.md#images-at-their-own-shape)."""
    patch_size: int = 0
    """resize native: the side of the patches images are cut into; 0: the model's (filled in by the
    config pass, before anything is built)."""
    mean: list[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    """Per-channel normalization mean, applied once per batch on the device."""
    std: list[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    """Per-channel normalization standard deviation."""
    jpeg_draft_ratio: float = 1.0
    """JPEGs may be decoded at 1/2, 1/4 or 1/8 scale down to this fraction of image_size, then
    upsampled: 1.0 never upsamples (exact); 0.8 decodes a 500x375 photo at 250x188 for 224, a
    faster decode for a slightly softer image (docs/benchmarks/data.md, "Data pipeline")."""
    jpeg_decoder: Literal["auto", "pillow"] = "auto"
    """auto: JPEGs are decoded by simplejpeg when it is installed, else by Pillow. simplejpeg
    decodes straight into one array and scales in the DCT by any of 1/8 .. 5/8 (Pillow: 1/2, 1/4,
    1/8 only), so a 500x375 photo going to 224 is decoded at 313x235 instead of in full: fewer
    pixels decoded and resized, at the price of pixels close to Pillow's but not identical (the
    speed and the distance: docs/benchmarks/data.md, "Data pipeline").
    pillow: always Pillow, for pixels identical to other Pillow-based pipelines."""
    interpolation: Literal["bicubic", "bilinear"] = "bicubic"
    """Resize filter (antialiased, on uint8). Bicubic is the filter CLIP-family checkpoints are
    preprocessed with; bilinear is a little cheaper and further from a Lanczos reference
    (docs/benchmarks/data.md, "Data pipeline")."""
    max_image_pixels: int = MAX_IMAGE_PIXELS
    """Decompression-bomb guard: images with more pixels are rejected as bad samples."""
    tokenizer: str = ""
    """A tokenizer.json file, or a folder holding one (e.g. a local Hugging Face model folder)."""
    text_clean: str = ""
    """Clean captions before the tokenizer sees them: "" (no); clip: ftfy.fix_text and html.unescape
    twice, as OpenAI's CLIP and OpenCLIP do (needs the ftfy package: vltrain[openclip]); lower:
    lower-case them, as transformers' SigLIP 2 tokenizer does. model.init of an OpenCLIP checkpoint
    sets clip, of a Siglip2Model folder lower."""
    max_text_length: int = 77
    """Token cap per caption, special tokens included; longer captions are cut and counted."""
    max_regions: int = 16
    """The most regions (boxes with a phrase, docs/formats.md#regions) a row keeps, in the row's order,
    after those a crop cut away; the rest are dropped and counted (data/regions_capped). 0: regions
    are not read."""
    pad_multiple: int = 0
    """Padded text widths are rounded up to a multiple of this, by the collator and the budget
    packer alike. 0 picks per batching: 8 with fixed batching (tensor-core friendly, few
    distinct widths to compile); 1 with budget batching, which groups rows by exact length and
    whose batches vary in rows anyway (so compiled code sees dynamic shapes either way), where
    rounding short captions to 8 would cost text positions for little gain (docs/benchmarks/data.md,
    "Padding and dynamic batching")."""
    csv: CsvConfig = field(default_factory=CsvConfig)
    cache_dir: str = ""
    """Where shard indexes go when a shard's folder is read-only, and where remote shards
    (s3://, gs://, https://) are downloaded to, whole, before they are read (empty: RUN_DIR/cache).
    Workers and ranks on one node may share it."""
    cache_limit_gb: float = 50.0
    """Remote shards kept in cache_dir: past this many GB the least recently used are deleted."""
    remote_retries: int = 2
    """Retries of a remote read after a network failure, waiting 0.5 s, then twice as long each time
    (2: about 1.5 s; 6: about 32 s). A store back within them loses no sample; past them the
    sample is replaced and counted, or the run stops (docs/formats.md#remote-sources)."""
    storage_options: dict[str, Any] = field(default_factory=dict)
    """Passed to fsspec for remote URLs, over the defaults (e.g. {endpoint_url: ..., anon: true});
    credentials otherwise come from the usual variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)."""
    num_workers: int = 2
    """Loader worker processes per rank (0: load in the training process)."""
    prefetch_factor: int = 2
    """Batches each worker prepares ahead."""
    persistent_workers: bool = True
    """Keep workers alive across epochs."""
    pin_memory: bool = True
    """Page-locked host batches for asynchronous copies to the GPU (ignored without CUDA)."""
    on_error: Literal["skip", "fail"] = "skip"
    """skip: replace unreadable samples, drop malformed rows, train on what damaged files still hold,
    logging all; fail: stop at the first (docs/formats.md#damaged-files)."""
    max_bad_fraction: float = 0.01
    """Stop when the rate of samples that fail to load, with those lost in damaged files, is above this
    with confidence (from 100 samples on), or at once when the first 16 all fail; 0: stop on the first
    (docs/formats.md#bad-samples)."""
    # sampling and batching
    shuffle: bool = True
    """A new order every epoch from (train.seed, epoch); false keeps the dataset order."""
    shuffle_window: int = -1
    """-1: 0 for local data, REMOTE_WINDOW (16) when a training source is remote or parquet
    (a parquet file is read by row group: the row groups are the blocks).
    0: each epoch is a full permutation of the samples (exact mixing; every rank holds 8 bytes
    per sample). N > 0: the windowed shuffle (vltrain.data.schedule.window): blocks (tar shards, or runs of
    4096 manifest rows) in a random order, N blocks at a time shuffled together, so a loader reads
    a few shards at a time and a rank holds O(one window). For remote shards and datasets of
    hundreds of millions of rows; 16 to 64 mixes well (docs/benchmarks/data.md, "Data at scale")."""
    remainder: Literal["pad", "drop"] = "pad"
    """Equal batch counts on every rank: pad the epoch by repeating samples, or drop the tail."""
    batching: Literal["fixed", "budget"] = "fixed"
    """fixed: data.batch_size rows per batch; budget: batches packed under token_budget, image_budget
    and patch_budget."""
    token_budget: int = 0
    """Budget batching: the most padded text positions per batch (0: batch_size x max_text_length / 2,
    at least one padded caption of max_text_length). With data.global_batch_size: per step, over
    every rank (0: global_batch_size x max_text_length / 2)."""
    image_budget: int = 0
    """Budget batching: the most images per batch (0: batch_size). With data.global_batch_size: per
    step, over every rank (0: global_batch_size)."""
    patch_budget: int = 0
    """Budget batching with resize native: the most image patches per batch, each image counted at
    the grid it is resized to, so a batch of small images holds more of them than one of large
    images (0: no patch budget). At least data.max_patches. With data.global_batch_size: per step,
    over every rank. The first run reads every image's header once to plan with
    (docs/formats.md#a-patch-budget-per-step)."""
    epoch_size: int = 0
    """Samples per epoch when data.train lists several sources, drawn by weight (0: all their rows)."""
    modality_weights: ModalityWeights = field(default_factory=ModalityWeights)
    audit: bool = False
    """Record the ids every rank consumed to RUN_DIR/audit/rank{R}.jsonl."""

    def __post_init__(self) -> None:
        self.train, self.val = as_specs(self.train), as_specs(self.val)

    def _validate_patches(self) -> None:
        """What the data alone decides of images at their own shape. What needs the architecture (the
        patch side) or may come from ``model.init`` (``resize``) is checked once the config pass has
        both: ``vltrain.compose.rules.fit_native``."""
        check_patch_budget(self.min_patches, self.max_patches)
        if self.patch_budget and self.batching != "budget":
            raise ConfigError("data.patch_budget plans batches by patch count, which budget batching does: set "
                              "data.batching budget, or data.patch_budget 0")
        if 0 < self.patch_budget < self.max_patches:
            raise ConfigError(f"data.patch_budget {self.patch_budget} is smaller than one image of data.max_patches "
                              f"({self.max_patches} patches): raise it to at least {self.max_patches}")
        if self.max_patches_choices and self.batching != "fixed":
            raise ConfigError("data.max_patches_choices draws each step's patch budget, which needs data.batching "
                              "fixed (budget batching plans steps by patch counts at data.max_patches); set one")
        outside = [n for n in self.max_patches_choices if not self.min_patches <= n <= self.max_patches]
        if outside:
            raise ConfigError(f"data.max_patches_choices {outside} outside [data.min_patches, data.max_patches] = "
                              f"[{self.min_patches}, {self.max_patches}]: data.max_patches is the most a step may hold")

    def at_own_shape(self) -> bool:
        """Whether images keep their own shape (``resize: native``), which packing them and a patch budget
        need. Asked once the resize is final (``model.init`` may give it), by the one layout decision
        (:func:`vltrain.data.image_input.image_layout`) and the config pass."""
        if self.resize == "native":
            return True
        need = {"data.pack_images": (self.pack_images, "packs", "false"),
                "data.patch_budget": (self.patch_budget, "counts the patches of", "0"),
                "data.max_patches_choices": (self.max_patches_choices, "draws the patch budget of", "[]")}
        for key, (value, what, off) in need.items():
            if value:
                raise ConfigError(f"{key} {what} images at their own shape: set data.resize native, or {key} {off}")
        return False

    def native_patch(self) -> int:
        """resize native: the side images are cut into, once the config pass has made it the model's
        (``vltrain.compose.rules.fit_native``); data code reads it here, never from a model."""
        if self.patch_size < 1:
            raise ConfigError("data.patch_size is not resolved: it is the model's patch size, which the config "
                              "pass sets before any image is read (vltrain.compose.rules.fit_native)")
        return self.patch_size

    def resolve(self) -> ResolvedBatching:
        """``pad_multiple``, ``token_budget`` and ``image_budget`` with 0 resolved for this config.

        The token budget is never below one padded caption of ``max_text_length``, so a default
        budget always admits the longest row. With a global batch the budgets are a step's."""
        multiple = self.pad_multiple or (1 if self.batching == "budget" else PAD_MULTIPLE)
        rows = self.global_batch_size or self.batch_size
        token_budget = self.token_budget or max(rows * self.max_text_length // 2,
                                                padded_width(self.max_text_length, multiple))
        return ResolvedBatching(multiple, token_budget, self.image_budget or rows, self.patch_budget)

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"data.batch_size must be >= 1, got {self.batch_size}")
        if self.global_batch_size < 0 or self.micro_batch_size < 0:
            raise ConfigError("data.global_batch_size and data.micro_batch_size must be >= 0 (0: not set)")
        if self.micro_batch_size and not self.global_batch_size:
            raise ConfigError("data.micro_batch_size splits data.global_batch_size, which is not set; set it, "
                              "or use data.batch_size")
        if self.image_size < 8:
            raise ConfigError(f"data.image_size must be >= 8, got {self.image_size}")
        if len(self.mean) != 3 or len(self.std) != 3:
            raise ConfigError("data.mean and data.std must each hold 3 numbers (R, G, B)")
        if any(s <= 0 for s in self.std):
            raise ConfigError(f"data.std must be positive, got {self.std}")
        if not 0 <= self.max_bad_fraction <= 1:
            raise ConfigError(f"data.max_bad_fraction must be in [0, 1], got {self.max_bad_fraction}")
        if not 0 <= self.remote_retries <= 20:
            raise ConfigError(f"data.remote_retries must be in [0, 20], got {self.remote_retries}")
        if not self.cache_limit_gb > 0:
            raise ConfigError(f"data.cache_limit_gb must be > 0, got {self.cache_limit_gb}")
        if self.num_workers < 0:
            raise ConfigError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if not 0.1 <= self.jpeg_draft_ratio <= 1.0:
            raise ConfigError(f"data.jpeg_draft_ratio must be in [0.1, 1], got {self.jpeg_draft_ratio}")
        if self.text_clean not in ("", "clip", "lower"):
            raise ConfigError(f"data.text_clean must be '', clip or lower, got {self.text_clean!r}")
        if self.max_text_length < 2:
            raise ConfigError(f"data.max_text_length must be >= 2, got {self.max_text_length}")
        if self.max_regions < 0:
            raise ConfigError(f"data.max_regions must be >= 0 (0: regions are not read), got {self.max_regions}")
        if self.shuffle_window < -1:
            raise ConfigError(f"data.shuffle_window must be >= 0 (-1: automatic), got {self.shuffle_window}")
        for key in ("token_budget", "image_budget", "patch_budget", "epoch_size", "pad_multiple"):
            if getattr(self, key) < 0:
                raise ConfigError(f"data.{key} must be >= 0 (0: the default), got {getattr(self, key)}")
        self._validate_patches()
        if not isinstance(self.train, str) and any(s.weight < 0 or s.loss_weight < 0 for s in self.train):
            raise ConfigError("data.train: source weight and loss_weight must be >= 0")
        for split in ("train", "val"):
            names = [s.display_name() for s in getattr(self, split)] if not isinstance(getattr(self, split), str) else []
            if len(set(names)) < len(names):
                raise ConfigError(f"data.{split}: sources need distinct names for their metrics, got {names}; "
                                  "give each a name: {path, weight, name}")


def teacher_data(student: DataConfig, teacher: DataConfig) -> DataConfig:
    """The data section a teacher reads the student's rows with: the student's sources and decoding
    limits, the teacher's image size, resize, interpolation, statistics, text length and cleaning, and
    for a teacher at native shape its patch budget and patch side. Its images are never packed: one
    per row, padded to its ``max_patches`` at every step."""
    keys = ("image_size", "resize", "interpolation", "mean", "std", "max_text_length", "text_clean", "tokenizer",
            "max_patches", "min_patches", "upscale", "patch_size")
    return revise(student, **{key: getattr(teacher, key) for key in keys}, pack_images=False, patch_budget=0,
                  max_patches_choices=[])
