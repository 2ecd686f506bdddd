"""``vltrain demo``: synthetic shapes -> tokenizer -> training -> retrieval and zero-shot metrics -> plot.

One command that shows the whole product learning something real on a laptop CPU: 20,000
training rows (a fifth of them text-only), 1,000 held-out pairs, the demo config, and a small
class-per-folder set (one shape per image) classified zero-shot by shape kind.

CPUs differ widely in training speed (bf16 matmuls above all: AMX, AVX-512 bf16, neither), so
the demo does not fix its step count: it times a short run of its own config on its own data
(``probe_rate``) and trains as many steps as fit ``TRAIN_SECONDS``, between ``MIN_STEPS`` (enough
to meet the demo's retrieval target: ``docs/benchmarks/demo.md#demo``) and ``MAX_STEPS``, rounded down
to a multiple of ``STEP_QUANTUM`` so a given machine gets the same count run after run.
``train.max_steps=N`` pins it.
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from vltrain.config.job import load_config
from vltrain.data.tools.synth import TOKENIZER_VOCAB
from vltrain.errors import ConfigError
from vltrain.model.builder import has_decoder
from vltrain.runtime.world import cpu_has_bf16_matmul

NUM_TRAIN, NUM_VAL, TEXT_ONLY_FRACTION = 20_000, 1_000, 0.2
"""20,000 rows rather than 10,000: at the 600-step floor the model saw each of 8,000 pairs about 8
times and generalized less to new captions (held-out R@1 0.789 against 0.814 on an Intel Xeon
with AMX: docs/benchmarks/demo.md#demo); writing them takes seconds."""
CLASSIFY_PER_CLASS = 30
"""The zero-shot set: one shape per image, 30 of each of the 6 kinds (a second or two per evaluation)."""
TRAIN_SECONDS, MIN_STEPS, MAX_STEPS, STEP_QUANTUM = 170.0, 600, 1000, 100
PROBE_WARMUP, PROBE_STEPS = 5, 40
"""The probe's untimed first steps (allocation, the loader worker's start) and its timed ones."""


def demo_config_path() -> Path:
    """configs/demo.yaml of the checkout (editable install) or the copy shipped in the package."""
    for candidate in (
        Path(__file__).resolve().parents[2] / "configs" / "demo.yaml",
        Path(__file__).resolve().parent / "configs" / "demo.yaml",
    ):
        if candidate.exists():
            return candidate
    raise ConfigError("configs/demo.yaml is missing from this installation")


def prepare_data(data: Path, num: int = NUM_TRAIN, val: int = NUM_VAL, seed: int = 0, regions: bool = False) -> Path:
    """Write the shapes and a tokenizer trained on their texts, unless already there; ``regions``:
    with each shape's box and phrase (the same rows and images, written again if they lack them)."""
    from vltrain.data.tools.synth import synthesize, synthesize_classify, write_tokenizer

    written = (data / "train.jsonl").exists() and (data / "val.jsonl").exists()
    if not written or (regions and not _has_regions(data / "val.jsonl")):
        print(f"writing {num:,} training rows and {val:,} held-out pairs to {data}"
              + " with their shapes' regions" * regions, flush=True)
        synthesize(data, num, val, text_only_fraction=TEXT_ONLY_FRACTION, seed=seed, with_regions=regions)
    if not (data / "classify" / "templates.txt").exists():
        synthesize_classify(data / "classify", CLASSIFY_PER_CLASS, seed=seed)
    return write_tokenizer(data)


HELD_OUT_CAPTIONS = 200
"""Held-out images the demo captions and scores (BLEU-4, CIDEr-D against the caption each was made
with), and, for a LocCa model, grounds (the phrase of each one's first region)."""


def _has_regions(manifest: Path) -> bool:
    import json

    with manifest.open() as f:
        return any("regions" in json.loads(line) for line, _ in zip(f, range(50)))


def has_locca(cfg) -> bool:
    """Whether the config trains a LocCa decoder (a siglip2 preset, or model.locca)."""
    arch = cfg.model.architecture()
    return has_decoder(arch, cfg.model.loss) and arch.decoder.standalone


def referring_set(data: Path, n: int = HELD_OUT_CAPTIONS) -> Path:
    """The first ``n`` held-out images with regions, each with its first region, as the JSON lines
    ``eval.referring`` reads."""
    import json

    out = data / "referring-heldout.jsonl"
    if not out.exists():
        rows = [json.loads(x) for x in (data / "val.jsonl").read_text().splitlines()]
        pairs = [{"image": r["image"], "text": r["regions"][0]["text"], "box": r["regions"][0]["box"]}
                 for r in rows if r.get("image") and r.get("regions")][:n]
        out.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return out


def draw_grounding(trainer, data: Path, out: Path, n: int = 4) -> Path:
    """``out`` (grounding.png): the first ``n`` held-out referring pairs, each image with its true box
    (green) and the box the trained model writes for the phrase (red)."""
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    from vltrain.eval.embedding import Encoder
    from vltrain.eval.grounding import ground_pairs, to_image_pixels, view_window

    pairs = [json.loads(x) for x in referring_set(data).read_text().splitlines()][:n]
    paths = [str(data / p["image"]) for p in pairs]
    encoder = Encoder(trainer.wrapped, trainer.cfg.data, trainer.device, trainer.precision.autocast)
    found = ground_pairs(encoder, trainer.tokenizer, paths, [p["text"] for p in pairs], rank=0, world_size=1,
                         batch_size=n)
    boxes = to_image_pixels(found.boxes, [view_window(p, trainer.cfg.data.resize) for p in paths])
    fig, axes = plt.subplots(1, len(pairs), figsize=(3 * len(pairs), 3.4), squeeze=False)
    for ax, pair, path, box in zip(axes[0], pairs, paths, boxes.tolist()):
        ax.imshow(Image.open(path).convert("RGB"))
        for (x0, y0, x1, y1), colour in ((pair["box"], "lime"), (box, "red")):
            ax.add_patch(plt.Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=colour, linewidth=2))
        ax.set_title(pair["text"], fontsize=8)
        ax.axis("off")
    fig.suptitle("true box (green), predicted (red)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out




def caption_set(data: Path, n: int = HELD_OUT_CAPTIONS) -> Path:
    """The first ``n`` held-out image-text pairs as a Karpathy split file (``eval.captions`` reads it)."""
    import json

    out = data / "captions-heldout.json"
    if not out.exists():
        rows = [json.loads(x) for x in (data / "val.jsonl").read_text().splitlines()]
        images = [{"filename": r["image"], "split": "test", "sentences": [{"raw": r["text"]}]}
                  for r in rows if r.get("image") and r.get("text")][:n]
        out.write_text(json.dumps({"images": images}))
    return out


def show_captions(trainer, data: Path, n: int = 4) -> list[tuple[str, str]]:
    """(truth, greedy caption) of the first ``n`` held-out images, from the trained model."""
    import json

    from vltrain.eval.captioning import Prompt, caption_paths
    from vltrain.eval.embedding import Encoder
    from vltrain.model.generate import Decoding

    cfg, tokenizer = trainer.cfg, trainer.tokenizer
    images = json.loads(caption_set(data).read_text())["images"][:n]
    paths = [str(data / im["filename"]) for im in images]
    encoder = Encoder(trainer.wrapped, cfg.data, trainer.device, trainer.precision.autocast)
    prompt = Prompt.of(tokenizer, "", cfg.data.max_text_length, cfg.model.architecture().text.start_id)
    texts, _ = caption_paths(encoder, tokenizer, paths, prompt, Decoding(cfg.data.max_text_length), rank=0,
                             world_size=1, batch_size=n)
    return [(im["sentences"][0]["raw"], text) for im, text in zip(images, texts)]


def random_pairs(batch: int, image_size: int, text_length: int, vocab: int, seed: int = 0, offset: int = 0):
    """``ModelInputs`` of ``batch`` random image-text pairs (ids from ``offset``), for timing steps."""
    import torch

    from vltrain.images import Images
    from vltrain.types import ModelInputs

    g = torch.Generator().manual_seed(seed)
    ones = torch.ones(batch, dtype=torch.bool)
    return ModelInputs(
        images=Images(torch.randn(batch, 3, image_size, image_size, generator=g)),
        input_ids=torch.randint(5, vocab, (batch, text_length), generator=g),
        attention_mask=torch.ones(batch, text_length, dtype=torch.long),
        has_image=ones, has_text=ones.clone(), ids=torch.arange(offset, offset + batch),
    )


def measure_rate(cfg, vocab: int = TOKENIZER_VOCAB, steps: int = 3) -> float:
    """Training samples/s of ``cfg``'s model on this machine, through the trainer's own step code
    (one warm-up step, then ``steps`` timed) on random pairs of full caption length."""
    import time as clock

    import torch

    from vltrain.model import build_model
    from vltrain.runtime.precision import Precision
    from vltrain.runtime.cpus import usable_cpus
    from vltrain.runtime.world import keep_freed_memory
    from vltrain.compose.builders import build_task
    from vltrain.train.optim import build_optimizer
    from vltrain.train.step import plain_backward

    keep_freed_memory()
    torch.set_num_threads(cfg.train.threads or usable_cpus())
    model = build_model(cfg.model, vocab_size=vocab, pad_id=0, mask_id=4, image_size=cfg.data.image_size,
                        max_text_length=cfg.data.max_text_length)
    optimizer, precision = build_optimizer(model, cfg.train), Precision(cfg.train.precision, torch.device("cpu"))
    task = build_task(cfg, model)
    inputs = [random_pairs(cfg.data.batch_size, cfg.data.image_size, cfg.data.max_text_length, vocab)]
    for i in range(steps + 1):
        if i == 1:
            start = clock.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        plain_backward(task, inputs, precision.autocast, backward=lambda loss: loss.backward())
        optimizer.step()
    return steps * cfg.data.batch_size / (clock.perf_counter() - start)


def probe_rate(given: list[str], steps: int = PROBE_STEPS, warmup: int = PROBE_WARMUP) -> float:
    """Training samples/s of the demo's run on this machine, measured as that run trains: the same
    config on the same data through the trainer and its loader (the loader worker decoding beside
    the step's threads on the same cores, the captions at their own widths), ``warmup`` steps
    untimed, then ``steps`` timed. A model step on random pairs alone (``measure_rate``) misses the
    loader's share of the cores, and on some CPUs overestimated the run's rate by a third."""
    from vltrain.train.metrics import read_jsonl

    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(io.StringIO()):
        cfg = load_config(demo_config_path(), [*given, f"run.dir={tmp}", f"train.max_steps={warmup + steps}",
                                               "train.log_every=1", "eval.every=0", "data.val=''",
                                               "eval.zeroshot=[]", "checkpoint.every=0"])
        _train(cfg)
        rows = [r for r in read_jsonl(Path(tmp) / "metrics.jsonl") if "loss" in r and r["step"] > warmup]
    return len(rows) / sum(1 / r["samples_per_s"] for r in rows)  # equal steps: the harmonic mean


def choose_steps(rate: float, batch: int) -> int:
    """The steps that fit ``TRAIN_SECONDS`` at ``rate`` samples/s, within [MIN_STEPS, MAX_STEPS]."""
    fit = int(rate * TRAIN_SECONDS / batch) // STEP_QUANTUM * STEP_QUANTUM
    return max(MIN_STEPS, min(MAX_STEPS, fit))


def _step_overrides(cfg, given: list[str]) -> list[str]:
    """``train.max_steps`` from this machine's measured rate (the config warms up over a tenth of it)."""
    rate = probe_rate(given)
    steps = choose_steps(rate, cfg.data.batch_size)
    note = ""
    if steps * cfg.data.batch_size / rate > TRAIN_SECONDS:
        note = f"; this CPU needs about {steps * cfg.data.batch_size / rate / 60:.1f} min for them"
    print(f"this CPU trains the demo model at about {rate:.0f} samples/s: {steps} steps{note} "
          f"(train.max_steps=N pins the count)", flush=True)
    return [f"train.max_steps={steps}"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def run_demo(run_dir: Path, data: Path, overrides: list[str], num: int = NUM_TRAIN, val: int = NUM_VAL):
    """Train the demo config end to end; returns (trainer, final eval metrics)."""
    locca = has_locca(load_config(demo_config_path(), list(overrides)))
    tokenizer = prepare_data(data, num, val, regions=locca)
    given = [
        f"run.dir={run_dir}",
        f"data.train={data / 'train.jsonl'}",
        f"data.val={data / 'val.jsonl'}",
        f"data.tokenizer={tokenizer}",
        f"eval.zeroshot=[{{name: shapes, path: '{data / 'classify'}', templates: '{data / 'classify' / 'templates.txt'}'}}]",
        *overrides,
    ]
    cfg = load_config(demo_config_path(), given)
    if has_decoder(cfg.model.architecture(), cfg.model.loss) and not cfg.eval.captions:
        given.insert(len(given) - len(overrides), f"eval.captions=[{{name: shapes, path: '{caption_set(data)}'}}]")
        cfg = load_config(demo_config_path(), given)
    if locca and not cfg.eval.referring:
        given.insert(len(given) - len(overrides), f"eval.referring=[{{name: shapes, path: '{referring_set(data)}'}}]")
        cfg = load_config(demo_config_path(), given)
    on_cpu = cfg.train.device != "cuda" and not _cuda()
    if on_cpu and cfg.train.precision == "bf16" and not any(o.startswith("train.precision=") for o in overrides):
        if not cpu_has_bf16_matmul():
            print("this CPU has no bf16 matrix instructions (AVX-512 BF16 or AMX): the demo trains in fp32, "
                  "several times faster here (train.precision=bf16 forces bf16)", flush=True)
            given.insert(len(given) - len(overrides), "train.precision=fp32")
            cfg = load_config(demo_config_path(), given)
    if on_cpu and not any(o.startswith("train.max_steps=") for o in overrides):
        cfg = load_config(demo_config_path(), given + _step_overrides(cfg, given) + list(overrides))
    return _train(cfg)


def _train(cfg):
    """Train ``cfg`` to its end in this process and close the trainer; returns (trainer, final eval
    metrics)."""
    from vltrain.train.trainer import Trainer

    trainer = Trainer(cfg)
    clean = False
    try:
        metrics = trainer.train()
        clean = True
    finally:
        trainer.close(clean)
    return trainer, metrics
