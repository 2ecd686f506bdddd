"""The job config: a tree of typed dataclasses, loaded from YAML, with dotted overrides.

Each component keeps its own config dataclass next to its code (``vltrain.data.config``,
``vltrain.model.config``); this module holds the job-level ones and composes the tree.
:mod:`vltrain.config.loading` turns YAML plus ``key.path=value`` overrides into it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from vltrain.config.loading import apply_override, dotted_keys, from_dict, read_yaml
from vltrain.config.stages import StageSettings, check_stages
from vltrain.data.config import DataConfig
from vltrain.errors import ConfigError
from vltrain.model.config import ModelConfig
from vltrain.model.lora import LoraSettings
from vltrain.types import Settings


@dataclass
class RunConfig(Settings):
    dir: str = "runs/default"
    """Everything a run writes goes here: config.yaml, metrics, checkpoints, bad_samples.jsonl."""
    name: str = ""
    """A label saved with the config; vltrain does not read it."""


@dataclass
class EmaSettings(Settings):
    """An exponential moving average of the trainable weights, kept in fp32 beside them (sharded
    like them under FSDP2), saved in every checkpoint, evaluated beside the trained weights, and
    what ``vltrain export --ema`` and ``vltrain eval --ema`` read (``vltrain.train.ema``)."""

    decay: float = 0.0
    """Each update: ema = decay x ema + (1 - decay) x weights. 0: no EMA. 0.999 averages over about
    the last 1,000 updates, 0.9999 over 10,000."""
    warmup: bool = False
    """Start with a short memory that grows to train.ema.decay: update t uses min(decay, 1 - (1 + t)^(-2/3))
    (timm's ModelEmaV3 warm-up), so early weights, far from the trained ones, fade quickly."""
    every: int = 1
    """Update every N optimizer steps (the decay applies per update: N x more steps of memory)."""

    def validate(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ConfigError(f"train.ema.decay must be in [0, 1) (0: no EMA; 0.999 is usual), got {self.decay}")
        if self.every < 1:
            raise ConfigError(f"train.ema.every must be >= 1 (update every N steps), got {self.every}")


@dataclass
class TrainConfig(Settings):
    max_steps: int = 1000
    """Optimizer steps of the run."""
    lr: float = 5e-4
    """Peak learning rate of AdamW."""
    min_lr_ratio: float = 0.0
    """The cosine schedule ends at lr x this."""
    warmup_steps: Union[int, float] = 100
    """Linear warmup: a number of steps, or a fraction of max_steps (a number below 1: 0.05 is 5%)."""
    weight_decay: float = 0.1
    """AdamW decay of weight matrices (never of norms, biases, embeddings, positions, temperature)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    """AdamW betas."""
    eps: float = 1e-6
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping)."""
    precision: Literal["fp32", "bf16", "fp16", "fp64"] = "bf16"
    """fp32; bf16 autocast (CPU and GPU); fp16 autocast with loss scaling. Weights and optimizer state
    stay fp32. fp64: everything in float64 (weights, activations, losses, optimizer state), several
    times slower: for checking the math, where fp32's rounding would hide a small change."""
    seed: int = 0
    """Seed of the initial weights, the data order and every rank's generators."""
    accumulation: int = 1
    """Micro-batches per optimizer step; global batch = data.batch_size x accumulation x world."""
    contrastive_accumulation: Literal["none", "gradcache"] = "none"
    """none: each micro-batch's contrastive loss sees only itself; gradcache: the exact contrastive gradient over
    the whole step."""
    parallelism: Literal["ddp", "fsdp"] = "ddp"
    """ddp: replicated parameters; fsdp: FSDP2, each transformer block sharded."""
    compile: bool = False
    """torch.compile each tower whole (under fsdp: each block); the first steps pay for compilation."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward: less memory, ~1/3 more compute."""
    tf32: bool = True
    """On CUDA, let fp32 matmuls use TF32 tensor cores (Ampere and newer); false for full fp32."""
    freeze: list[str] = field(default_factory=list)
    """Towers to freeze (LiT-style), e.g. ["vision"]."""
    unlock_last: Union[int, dict[str, int]] = 0
    """Of each tower in train.freeze, this many last blocks (and the tower's final norm) still
    train; or per tower, e.g. {vision: 2}. 0: the frozen towers are frozen whole."""
    layer_decay: float = 1.0
    """Layer-wise lr decay, in (0, 1]: a parameter in layer l of a stack of n blocks trains at
    lr x layer_decay^(n + 1 - l), embeddings being layer 0 and block i layer i + 1; the final norms,
    projections, temperature and heads at lr. 1.0: every parameter at lr (docs/checkpoints.md#fine-tuning)."""
    resume: str = "auto"
    """auto (latest complete checkpoint of run.dir) | never | a checkpoint path."""
    resume_drop: list[str] = field(default_factory=list)
    """State the resumed checkpoint holds that this run may leave behind: [ema] resumes an EMA run
    without its averages. Without it such a resume is refused, since the next checkpoints would not
    hold them and checkpoint.keep would delete the ones that do."""
    log_every: int = 10
    """Log a metrics line every N steps (and at the last step)."""
    max_nonfinite_steps: int = 5
    """Consecutive skipped (non-finite) steps that stop the run with exit code 3 (0: never stop)."""
    timeout_s: float = 600.0
    """Process-group timeout: a rank that fails makes the others exit within this time."""
    threads: int = 0
    """Intra-op threads per process (0: the CPUs this process may use, its affinity under taskset or Slurm,
    divided by the local world size)."""
    deterministic: bool = False
    """CUDA: bit-identical runs (deterministic kernels, a fixed cuBLAS workspace, attention in the math
    backend), at a cost in speed. A CPU step is deterministic at any fixed thread count without it."""
    progress: bool = True
    """A tqdm bar on rank 0 (only when stderr is a terminal)."""
    device: str = "auto"
    """auto (CUDA when present, else CPU) | cpu | cuda."""
    debug_nan_step: int = -1
    """Fault injection: multiply the loss by NaN at this step (-1: never), to see the guard work."""
    debug_nan_rank: int = -1
    """The rank whose loss debug_nan_step poisons (-1: every rank)."""
    ema: EmaSettings = field(default_factory=EmaSettings)
    """Weight EMA (off by default)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters through peft (off by default: rank 0); with them only the adapters train."""
    stages: list[StageSettings] = field(default_factory=list)
    """Training in stages: each entry starts at a step or a fraction of the run and changes loss
    weights, patch dropout, the EMA teacher or the schedule's pace from there on
    (vltrain.config.stages, docs/stages.md). Empty: one stage, the config as given."""
    debug_spmd: bool = False
    """Before each of vltrain's collectives, the ranks compare what they are about to issue (op,
    dtype, shape, and a fingerprint of the step's collectives so far); a divergence stops every
    rank with one message naming the step, the two ranks and the collective. Costs one small
    all_gather per collective."""

    def warmup(self) -> int:
        """Warmup steps, a fraction (``train.warmup_steps`` below 1) taken of ``max_steps``."""
        w = self.warmup_steps
        return int(round(w * self.max_steps)) if isinstance(w, float) and w < 1 else int(w)

    def validate(self) -> None:
        if self.max_steps < 1:
            raise ConfigError(f"train.max_steps must be >= 1, got {self.max_steps}")
        if self.accumulation < 1:
            raise ConfigError(f"train.accumulation must be >= 1, got {self.accumulation}")
        if self.warmup_steps < 0 or self.lr <= 0:
            raise ConfigError("train.lr must be > 0 and train.warmup_steps >= 0")
        if len(self.betas) != 2:
            raise ConfigError(f"train.betas must hold two numbers, got {self.betas}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"train.device must be auto, cpu or cuda, got {self.device!r}")
        if not 0 < self.layer_decay <= 1:
            raise ConfigError(f"train.layer_decay must be in (0, 1] (1.0: off; fine-tuning uses ~0.65-0.75), "
                              f"got {self.layer_decay}")
        self._validate_unlock()
        self.ema.validate()
        self.lora.validate()
        if self.lora.enabled and self.freeze:
            raise ConfigError(f"train.freeze={self.freeze} with train.lora: LoRA freezes every weight but the "
                              "adapters already; name the towers that get adapters in train.lora.towers instead")
        stray = [name for name in self.resume_drop if name not in DROPPABLE]
        if stray:
            raise ConfigError(f"train.resume_drop names {', '.join(stray)}; it takes only "
                              f"{', '.join(DROPPABLE)} (state a checkpoint may hold that a run may leave behind)")

    def _validate_unlock(self) -> None:
        counts = self.unlock_last if isinstance(self.unlock_last, dict) else {t: self.unlock_last for t in self.freeze}
        if any(n < 0 for n in counts.values()):
            raise ConfigError(f"train.unlock_last must be >= 0 blocks, got {self.unlock_last}")
        if not self.freeze and self.unlock_last:
            raise ConfigError("train.unlock_last unlocks blocks of the towers in train.freeze, which is empty; "
                              "set train.freeze (e.g. [vision]) or leave unlock_last at 0")
        stray = [t for t in counts if t not in self.freeze]
        if stray:
            raise ConfigError(f"train.unlock_last names {', '.join(stray)}, not in train.freeze {self.freeze}: "
                              "a tower that is not frozen trains whole")


DROPPABLE = ("ema",)
"""What ``train.resume_drop`` may name: a checkpoint's states a run can go on without."""


@dataclass
class ZeroShotSet(Settings):
    name: str = ""
    """Metrics are written as zeroshot/NAME/top1, top5, mean_per_class."""
    path: str = ""
    """A folder with one sub-folder of images per class (class names from the folder names, or from
    its classnames.txt), or a JSONL/CSV manifest with image and label columns."""
    templates: str = ""
    """A file of prompt templates, one per line with {} for the class name (empty: the built-in set)."""

    def validate(self) -> None:
        _check_set_name("eval.zeroshot", self.name, self.path)


@dataclass
class RetrievalSet(Settings):
    name: str = ""
    """Metrics are written as retrieval/NAME/i2t_r1 ... (and itm_i2t_r1 ... when re-ranked)."""
    path: str = ""
    """A COCO-style caption JSON: the Karpathy split file, or a captions_*.json with annotations."""
    split: str = "test"
    """The Karpathy file's split to evaluate (the annotations format has none: every image)."""
    image_root: str = ""
    """Folder the image paths are relative to (empty: the JSON's folder)."""

    def validate(self) -> None:
        _check_set_name("eval.retrieval", self.name, self.path)


@dataclass
class CaptionEvalSet(Settings):
    name: str = ""
    """Metrics are written as captions/NAME/bleu4, captions/NAME/cider (CIDEr-D), as pycocoevalcap
    computes them."""
    path: str = ""
    """A COCO-style caption JSON (the one eval.retrieval reads): each image's captions are its references."""
    split: str = "test"
    """The Karpathy file's split to evaluate (the annotations format has none: every image)."""
    image_root: str = ""
    """Folder the image paths are relative to (empty: the JSON's folder)."""
    beam: int = 1
    """Beams of the search (1: greedy)."""
    max_length: int = 0
    """Tokens a caption may take, the start token included (0: data.max_text_length)."""
    prompt: str = ""
    """Text every caption starts with (e.g. "a photo of")."""

    def validate(self) -> None:
        _check_set_name("eval.captions", self.name, self.path)
        if self.beam < 1:
            raise ConfigError(f"eval.captions {self.name}: beam must be >= 1 (1: greedy), got {self.beam}")
        if self.max_length < 0:
            raise ConfigError(f"eval.captions {self.name}: max_length must be >= 0 (0: data.max_text_length), "
                              f"got {self.max_length}")


@dataclass
class ReferringEvalSet(Settings):
    name: str = ""
    """Metrics are written as referring/NAME/acc50 (the share of boxes with IoU >= 0.5 against the
    true one, RefCOCO's Acc@0.5) and referring/NAME/miou."""
    path: str = ""
    """JSON lines {"image": PATH, "text": PHRASE, "box": [x0, y0, x1, y1]}, the box in pixels of the image as shown."""
    image_root: str = ""
    """Folder the image paths are relative to (empty: the file's folder)."""

    def validate(self) -> None:
        _check_set_name("eval.referring", self.name, self.path)


@dataclass
class DenseEvalSet(Settings):
    name: str = ""
    """Metrics are written as dense/NAME/miou (a linear probe on the frozen patch tokens, trained on
    the first half of the rows, scored on the rest: mean IoU over the classes present, at patch
    level) and dense/NAME/iou_CLASS."""
    path: str = ""
    """JSON lines {"image": PATH, "mask": PATH}, the mask a mode-L PNG of class indices the image's
    size; the class names in NAME_classes.json beside it (docs/formats.md#dense-masks)."""
    image_root: str = ""
    """Folder the image and mask paths are relative to (empty: the file's folder)."""

    def validate(self) -> None:
        _check_set_name("eval.dense", self.name, self.path)


def _check_set_name(key: str, name: str, path: str) -> None:
    if not name or "/" in name or not path:
        raise ConfigError(f"each entry of {key} needs a name (no '/') and a path, got name={name!r} path={path!r}")


@dataclass
class EvalConfig(Settings):
    every: int = 0
    """Evaluate on data.val, eval.zeroshot, eval.retrieval and eval.captions every N steps (0: only at the end)."""
    batch_size: int = 256
    """Evaluation batch per rank."""
    max_samples: int = 0
    """Evaluate data.val's first N image-text pairs in file order (0: all): the same pairs on any
    number of ranks and at any eval.batch_size."""
    early_stop_metric: str = ""
    """Any key of `eval.json`: i2t_r1 ... mean_recall, itm_t2i_r1 ..., zeroshot/NAME/top1, retrieval/NAME/t2i_r1 ...
    (empty: no early stop; a key the evaluation does not produce stops the run with the list of those it does)."""
    early_stop_patience: int = 0
    """Evaluations without improvement before stopping (0: never)."""
    early_stop_mode: Literal["max", "min"] = "max"
    """Early stopping: stop when eval metric early_stop_metric (e.g. t2i_r1 or zeroshot/NAME/top1)
    has not improved for early_stop_patience evaluations (0: never stop early)."""
    zeroshot: list[ZeroShotSet] = field(default_factory=list)
    """Zero-shot classification sets: [{name, path, templates}]."""
    retrieval: list[RetrievalSet] = field(default_factory=list)
    """Multi-caption retrieval sets (COCO, Flickr30k): [{name, path, split}]."""
    itm_rerank_k: int = 16
    """Fusion models: re-score each query's top k candidates with the ITM head (0: off)."""
    captions: list[CaptionEvalSet] = field(default_factory=list)
    """Caption sets (COCO, Flickr30k: the Karpathy JSON) that a model with a captioning decoder
    captions, scored with BLEU-4 and CIDEr-D: [{name, path, split, beam, max_length, prompt}]."""
    referring: list[ReferringEvalSet] = field(default_factory=list)
    """Referring-expression sets that a model with a LocCa decoder grounds, scored with Acc@0.5 and
    mean IoU: [{name, path, image_root}]."""
    dense: list[DenseEvalSet] = field(default_factory=list)
    """Segmentation sets on which a linear probe of the frozen vision tower's patch tokens is
    trained and scored with mean IoU (SigLIP 2's dense features): [{name, path, image_root}]."""

    def validate(self) -> None:
        if self.itm_rerank_k < 0:
            raise ConfigError(f"eval.itm_rerank_k must be >= 0 (0: no re-ranking), got {self.itm_rerank_k}")
        for key, sets in (("eval.zeroshot", self.zeroshot), ("eval.retrieval", self.retrieval),
                          ("eval.captions", self.captions), ("eval.referring", self.referring),
                          ("eval.dense", self.dense)):
            names = [s.name for s in sets]
            if len(set(names)) != len(names):
                raise ConfigError(f"{key}: names must differ, got {names}")


@dataclass
class CheckpointConfig(Settings):
    every: int = 0
    """Save every N steps (0: only at the end)."""
    every_minutes: float = 0.0
    """Also save once this many minutes have passed since the last save (0: off), at the step where
    the first rank sees it: a lost node then costs at most that much training."""
    keep: int = 3
    """Newest complete checkpoints kept (0: all)."""
    async_save: bool = False
    """Write tensors in the background (DCP async save); the next save or the run's end commits them."""
    folder: str = "checkpoints"
    """Relative to run.dir, or an absolute path."""
    save_initial: Literal["auto", "always", "never"] = "auto"
    """Write the weights the run starts from to RUN_DIR/init.safetensors, for `vltrain export
    --interpolate` (WiSE-FT). auto: when model.init is set (a fine-tune); always; never."""

    def validate(self) -> None:
        if self.every < 0:
            raise ConfigError(f"checkpoint.every must be >= 0 (0: only at the end), got {self.every}")
        if self.every_minutes < 0:
            raise ConfigError(f"checkpoint.every_minutes must be >= 0 (0: off), got {self.every_minutes}")
        if self.keep < 0:
            raise ConfigError(f"checkpoint.keep must be >= 0 (0: keep all), got {self.keep}")
        if not self.folder:
            raise ConfigError("checkpoint.folder must not be empty (default: checkpoints)")


@dataclass
class MetricsConfig(Settings):
    curves: bool = True
    """Draw RUN_DIR/curves.png (loss, lr, throughput, evaluations) when the run ends, on rank 0.
    Off for many short runs (sweeps, tests): drawing costs about a second of matplotlib per run."""
    wandb: bool = False
    """Log the same scalars and evaluations as TensorBoard, and the resolved config, to Weights &
    Biases (rank 0; needs the optional `wandb` package). The W&B run id is kept in RUN_DIR/wandb_id,
    so a resumed run continues the same W&B run. WANDB_MODE=offline writes it locally."""
    wandb_project: str = "vltrain"
    """W&B project."""
    wandb_entity: str = ""
    """Empty: W&B's default entity for the logged-in user."""
    wandb_name: str = ""
    """Empty: run.name, else the run folder's name."""
    wandb_tags: list[str] = field(default_factory=list)
    """W&B tags."""


@dataclass
class JobConfig(Settings):
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)

    def validate(self) -> None:
        """What one section cannot check alone: the stages against the run's length and losses."""
        tc = self.train
        check_stages(tc.stages, tc.max_steps, self.model.loss)
        if any(s.teacher for s in tc.stages) and not tc.ema.decay:
            first = next(i for i, s in enumerate(tc.stages, 1) if s.teacher)
            raise ConfigError(f"train.stages {tc.stages[first - 1].label(first)}: teacher: true is the EMA of the "
                              "student, and train.ema.decay is 0; set it (SigLIP 2 and DINO: 0.996 to 0.9999)")
        self._validate_stage_data()

    def staged_data(self) -> list[tuple[str, dict]]:
        """``(label, settings)`` of each stage that changes the images: every ``data.*`` setting that
        stages have set up to it, which ``dataclasses.replace(cfg.data, **settings)`` reads from there on."""
        data: dict = {}
        out = []
        for i, s in enumerate(self.train.stages, 1):
            if s.data():
                data.update(s.data())
                out.append((f"train.stages {s.label(i)}", dict(data)))
        return out

    def _validate_stage_data(self) -> None:
        """Each stage's images as data.* would be checked, on fixed batching (whose steps do not depend
        on the layout, so the data position carries over a crossing)."""
        for label, data in self.staged_data():
            if self.data.batching != "fixed":
                raise ConfigError(f"{label}: a stage that changes the images needs data.batching fixed (budget "
                                  "batches are planned by the images' sizes); set it, or move the change to stage 0")
            try:
                staged = dataclasses.replace(self.data, **data)
                staged.validate()
                staged.at_own_shape()
            except ConfigError as e:
                raise ConfigError(f"{label}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        """Write ``config.yaml``, atomically: the one writer of a run's, a checkpoint's and an export's.
        Only a decided config is saved (:func:`vltrain.compose.decide.decide` freezes it), so what a
        folder's config says is what the command used."""
        if not self._frozen:
            raise ValueError("only a decided config is saved: decide it first (vltrain.compose.decide.decide)")
        path = Path(path)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "w") as f:
            f.write(self.to_yaml())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def was_set(self, key: str) -> bool:
        """Whether dotted ``key`` was given (in the YAML file or an override) or differs from its
        default: what ``model.init`` leaves alone when it fills in the checkpoint's preprocessing."""
        if key in getattr(self, "given", ()):
            return True
        node, default = self, JobConfig()
        for part in key.split("."):
            node, default = getattr(node, part), getattr(default, part)
        return node != default

    def asked(self, key: str) -> bool:
        """Whether dotted ``key`` was given on the command line: asked for in this command. A config
        file's section may serve several presets (configs/demo.yaml's ITM weight waits for a preset
        with ITM), so a value there is not a demand that the model can meet."""
        return key in getattr(self, "on_line", ())


# ---------------------------------------------------------------------------------------------
# Loading


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML file (optional), apply ``key.path=value`` overrides, validate, return the tree."""
    raw: dict[str, Any] = read_yaml(path) if path is not None else {}
    for item in overrides or []:
        apply_override(JobConfig, raw, item)
    cfg = from_dict(JobConfig, raw)
    cfg.given = frozenset(dotted_keys(raw))
    cfg.on_line = frozenset(item.partition("=")[0].strip() for item in overrides or [])
    return cfg
