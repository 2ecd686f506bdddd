"""Images at their own shape (``data.resize: native``) against square crop and squash: what it buys
and what it costs, at the same number of patches per image.

1. **The benefit.** A shapes set whose label sits near one end of a wide or tall image: 3:1 and 1:3
   canvases (144 x 48 and 48 x 144 by default), one large shape each, drawn by the shapes renderer
   (``vltrain.data.tools.synth.render``) in an end cell of a 3 x 3 grid, moved at most a fifth of
   a cell towards the middle, and captioned with its colour and kind. A centre crop keeps the
   middle third, so it keeps at most a sliver of the shape (the script prints how much); squash
   keeps the shape, narrowed 3x along the long side; native keeps it nearly as drawn (a 3:1 image
   becomes a 2 x 4 grid). The same tiny-clip is trained with each of the three (``vltrain train``:
   same steps, seed, batch, data order and schedule), then evaluated zero-shot on a held-out
   class-per-folder set of such images (``vltrain eval RUN --zeroshot``: six shape kinds, one
   prompt per colour), each run with the preprocessing it was trained with. Patches: crop and
   squash at ``--image-size`` (48: 3 x 3 patches of 16), native within ``data.max_patches`` of the
   same count (9), which a 3:1 image fills as 2 x 4 (8): native sees no more patches than the
   square methods, and its position table is the same 3 x 3.

2. **The cost.** Training samples/s of ``--preset`` (clip-vit-b32) with crop at 224 px (7 x 7 = 49
   patches of 32) against native within 49 patches, on the same images of aspect ratios 1:3 to
   3:1, in one process: one model, one optimizer, the trainer's own step code (forward + backward
   + AdamW), the two kinds of batch alternating step by step so that other load on the machine
   falls on both; the images decoded and collated beforehand by the loader's own code
   (``decode_for``, ``Collator``), whose per-image decode time is printed beside. Native pads every
   image to max_patches, so its sequence is as long as crop's; the share of those positions that
   hold real patches, what native wastes, is printed per aspect ratio.

Target: native zero-shot top-1 at least 0.2 above crop's, at no more patches per image; native
training steps at least 0.9x crop's samples/s.

    PYTHONPATH=src python benchmarks/native_shape.py [--steps 500] [--batch 128] [--rows 6000]
        [--per-class 100] [--seed 0] [--preset clip-vit-b32] [--throughput-batch 32] [--throughput-steps 4]
        [--precisions fp32,bf16] [--only benefit|cost] [--methods crop,squash,native] [--keep DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from vltrain.config.job import load_config
from vltrain.data.batch import Batch
from vltrain.data.dataset import Sample
from vltrain.data.image_input import decode_for
from vltrain.data.loading.collate import Collator
from vltrain.data.native import native_grid
from vltrain.data.tools.synth import COLORS, KIND_WORDS, KINDS, SIZES, Shape, render
from vltrain.model import build_model
from vltrain.model.presets import PRESETS
from vltrain.runtime.precision import Precision, cpu_has_bf16_matmul
from vltrain.runtime.world import keep_freed_memory
from vltrain.compose.builders import build_task
from vltrain.train.optim import build_optimizer
from vltrain.train.step import plain_backward

SRC = Path(__file__).resolve().parents[1] / "src"
METHODS = ("crop", "squash", "native")
TINY_PATCH = PRESETS["tiny-clip"]().vision.patch_size
INWARD = 0.2
"""How far a shape's centre may move from its end cell's centre towards the middle, in cells: far
enough to vary the position, near enough that a centre crop keeps at most a sliver of the shape
(under a tenth of its pixels)."""
ASPECTS = ((1, 3), (1, 2), (2, 3), (1, 1), (3, 2), (2, 1), (3, 1))
"""Width:height of the throughput images, from tall to wide."""


# --- 1. the benefit: a label near an edge ---------------------------------------------------------


def edge_image(kind: str, rng: random.Random, short: int) -> tuple[Image.Image, Shape]:
    """A 3:1 or 1:3 image (short x 3 short), one shape of ``kind`` in an end cell: the middle band
    of a 3 x 3 shapes scene rendered at 3 x short."""
    color = rng.choice(sorted(COLORS))
    slack = (1 - SIZES["large"]) / 2  # the room between a shape and its cell's edge
    end, tall = rng.choice((0, 2)), rng.random() < 0.5
    inward = rng.uniform(-slack, INWARD) * (1 if end == 0 else -1)
    across = rng.uniform(-slack, slack)
    cell, jitter = ((end, 1), (across, inward)) if tall else ((1, end), (inward, across))
    shape = Shape(kind, color, "large", cell, jitter)
    box = (short, 0, 2 * short, 3 * short) if tall else (0, short, 3 * short, 2 * short)
    return render([shape], 3 * short, rng).crop(box), shape


def caption(shape: Shape, rng: random.Random) -> str:
    """Colour and kind in the shapes set's words, never where the shape is."""
    prefix = rng.choice(("", "", "a picture of ", "an image with ", "there is "))
    return f"{prefix}{article(shape.color)} {shape.color} {rng.choice(KIND_WORDS[shape.kind])}"


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def write_edge_set(out: Path, rows: int, per_class: int, short: int) -> None:
    """``out/train.jsonl`` (``rows`` image-caption pairs), ``out/classify/KIND/*.png`` (``per_class``
    held-out images per kind, from their own random stream) and its templates."""
    (out / "images").mkdir(parents=True)
    with open(out / "train.jsonl", "w") as f:
        for i in range(rows):
            rng = random.Random(f"edge/train/{i}")
            image, shape = edge_image(rng.choice(KINDS), rng, short)
            image.save(out / "images" / f"{i:05d}.png", compress_level=1)
            row = {"id": f"edge-{i:05d}", "image": f"images/{i:05d}.png", "text": caption(shape, rng)}
            f.write(json.dumps(row) + "\n")
    for kind in KINDS:
        (out / "classify" / kind).mkdir(parents=True)
        for i in range(per_class):
            image, _ = edge_image(kind, random.Random(f"edge/classify/{kind}/{i}"), short)
            image.save(out / "classify" / kind / f"{i:04d}.png", compress_level=1)
    (out / "classify" / "templates.txt").write_text("".join(f"{article(c)} {c} {{}}\n" for c in COLORS))


def train_config(data: Path, args: argparse.Namespace) -> dict:
    """The demo's recipe for tiny-clip. The runs differ only in data.resize; data.max_patches, the
    square's patch count, is read by native alone."""
    side = args.image_size // TINY_PATCH
    return {
        "data": {"train": str(data / "train.jsonl"), "val": None, "tokenizer": str(data / "tokenizer.json"),
                 "image_size": args.image_size, "max_patches": side * side, "mean": [0.5] * 3, "std": [0.5] * 3,
                 "max_text_length": 16, "batch_size": args.batch, "num_workers": 1, "persistent_workers": True},
        "model": {"preset": "tiny-clip"},
        "train": {"max_steps": args.steps, "lr": 1e-3, "warmup_steps": 0.1, "min_lr_ratio": 0.05,
                  "weight_decay": 0.1, "precision": args.train_precision, "grad_clip": 1.0, "log_every": 100,
                  "seed": args.seed, "threads": args.threads},
        "eval": {"every": 0},
        "checkpoint": {"every": 0},
    }


def vltrain(*argv: str) -> subprocess.CompletedProcess:
    """The CLI as a user runs it, on this checkout's sources."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "vltrain", *argv], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"vltrain {' '.join(argv)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return out


def patches_per_image(method: str, data: Path, args: argparse.Namespace) -> float:
    """The real patches an image of the set becomes, averaged over the held-out images."""
    side = args.image_size // TINY_PATCH
    if method != "native":
        return float(side * side)
    sizes = [Image.open(p).size for p in sorted((data / "classify").glob("*/*.png"))]
    return statistics.mean(r * c for r, c in (native_grid(h, w, TINY_PATCH, side * side) for w, h in sizes))


def crop_keeps(data: Path) -> tuple[float, float]:
    """What a centre crop keeps of the held-out images' shapes: the share of images where it keeps
    any of the shape's pixels, and the mean share of those pixels it keeps. A square crop of a 3:1
    image is its middle third, whatever the crop's size; a pixel is the shape's where it differs
    from the background, read at the image's centre, which no shape reaches."""
    some, kept = [], []
    for path in sorted((data / "classify").glob("*/*.png")):
        pixels = np.asarray(Image.open(path).convert("RGB"), dtype=np.int32)
        if pixels.shape[0] > pixels.shape[1]:
            pixels = pixels.transpose(1, 0, 2)  # tall to wide
        h, w = pixels.shape[:2]
        shape = np.abs(pixels - pixels[h // 2, w // 2]).sum(axis=-1) > 40
        middle = int(shape[:, w // 3: 2 * w // 3].sum())
        some.append(middle > 0)
        kept.append(middle / int(shape.sum()))
    return statistics.mean(some), statistics.mean(kept)


def trainer_rate(run: Path) -> float:
    """The median of the samples/s the trainer logged."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["samples_per_s"] for r in rows if "samples_per_s" in r)


def zeroshot_top1(run: Path, classify: Path) -> float:
    templates = str(classify / "templates.txt")
    out = vltrain("eval", str(run), "--zeroshot", str(classify), "--templates", templates, "--json")
    metrics = json.loads(out.stdout[out.stdout.index("{"):])
    return next(v for k, v in metrics.items() if k.endswith("/top1"))


def benefit(work: Path, args: argparse.Namespace) -> None:
    data = work / "edge"
    start = time.perf_counter()
    write_edge_set(data, args.rows, args.per_class, args.short)
    vltrain("tokenizer", "train", str(data / "train.jsonl"), "--out", str(data / "tokenizer.json"),
            "--vocab-size", "512")
    some, kept = crop_keeps(data)
    config = work / "edge.yaml"
    config.write_text(yaml.safe_dump(train_config(data, args), sort_keys=False))
    print(f"data: {args.rows} training pairs, {args.per_class * len(KINDS)} held-out images "
          f"({args.short * 3}x{args.short} and {args.short}x{args.short * 3}), written in "
          f"{time.perf_counter() - start:.0f} s; a centre crop keeps some of the shape in {some:.0%} of the held-out "
          f"images, {kept:.1%} of its pixels on average")
    print(f"tiny-clip, {args.steps} steps of {args.batch}, {args.train_precision}, seed {args.seed}; zero-shot over "
          f"{len(KINDS)} shape kinds, {len(COLORS)} prompts each (one per colour); {load_average()}")
    side = args.image_size // TINY_PATCH
    print("| resize | patches per image | sequence | train time | trainer samples/s | zero-shot top-1 |")
    print("|---|---:|---:|---:|---:|---:|")
    for method in args.methods.split(","):
        run = work / f"run-{method}"
        start = time.perf_counter()
        vltrain("train", str(config), f"run.dir={run}", f"data.resize={method}")
        seconds = time.perf_counter() - start
        print(f"| {method} | {patches_per_image(method, data, args):.2f} | {side * side} | {seconds:.0f} s "
              f"| {trainer_rate(run):.0f} | {zeroshot_top1(run, data / 'classify'):.3f} |", flush=True)


# --- 2. the cost: throughput and padding ----------------------------------------------------------


def mixed_images(n: int, area: int = 320 * 320) -> list[bytes]:
    """PNGs of about ``area`` pixels cycling through ASPECTS: shapes scenes stretched to each ratio."""
    out = []
    for i in range(n):
        a, b = ASPECTS[i % len(ASPECTS)]
        w, h = round((area * a / b) ** 0.5), round((area * b / a) ** 0.5)
        rng = random.Random(f"mixed/{i}")
        image = render([Shape(rng.choice(KINDS), "red", "large", (1, 1), (0.0, 0.0))], 96, rng).resize((w, h))
        buf = io.BytesIO()
        image.save(buf, "PNG", compress_level=1)
        out.append(buf.getvalue())
    return out


def decoded_batch(cfg, images: list[bytes], text_length: int) -> tuple[Batch, float]:
    """The images as the loader makes them (decode, resize, collate), with random full-length
    captions; and the decode time per image."""
    seconds = float("inf")
    for _ in range(3):  # the best of three passes: decoding is short and the machine is shared
        start = time.perf_counter()
        decoded = [decode_for(data, cfg.data) for data in images]
        seconds = min(seconds, (time.perf_counter() - start) / len(images))
    g = torch.Generator().manual_seed(0)
    samples = [Sample(i, str(i), image, torch.randint(5, 500, (text_length,), generator=g).tolist(), False, 0,
                      grid=grid) for i, (image, grid) in enumerate(decoded)]
    return Collator.for_data(0, cfg.data)(samples), seconds


def step_rates(args: argparse.Namespace, precision: str, images: list[bytes]) -> dict:
    """Samples/s of crop and native steps, alternating, with one model; decode ms per image."""
    patch = PRESETS[args.preset]().vision.patch_size
    side = 224 // patch
    base = [f"model.preset={args.preset}", "data.image_size=224", f"train.precision={precision}",
            f"data.max_patches={side * side}", f"data.patch_size={patch}"]
    cfgs = {m: load_config(None, [*base, f"data.resize={m}"]) for m in ("crop", "native")}
    text_length = cfgs["crop"].data.max_text_length
    torch.manual_seed(0)
    model = build_model(cfgs["crop"].model, vocab_size=512, pad_id=0, mask_id=4, image_size=224,
                        max_text_length=text_length)
    task = build_task(cfgs["crop"], model)
    optimizer = build_optimizer(model, cfgs["crop"].train)
    autocast = Precision(precision, torch.device("cpu")).autocast
    inputs, decode = {}, {}
    for m, cfg in cfgs.items():
        batch, decode[m] = decoded_batch(cfg, images, text_length)
        inputs[m] = batch.to_model_inputs("cpu", cfg.data.mean, cfg.data.std)

    def step(m: str) -> float:
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        plain_backward(task, [inputs[m]], autocast, backward=lambda loss: loss.backward())
        optimizer.step()
        return time.perf_counter() - start

    times = {m: [] for m in cfgs}
    for i in range(args.throughput_steps + 1):
        for m in (("crop", "native") if i % 2 else ("native", "crop")):
            t = step(m)
            if i:  # the first round warms up
                times[m].append(t)
    rates = {m: {"sps": len(images) / statistics.median(times[m]), "decode_ms": decode[m] * 1e3} for m in cfgs}
    grids = inputs["native"].images.grids
    rates["native"]["real"] = float(grids.prod(dim=1).sum()) / (len(images) * side * side)
    return rates


def real_share_table(budgets: tuple[tuple[int, int], ...]) -> None:
    """Per aspect ratio: the grid native makes of a 320 x 320-pixel-area image and its real share."""
    print("| aspect (w:h) | " + " | ".join(f"grid within {b} of {p} px | real" for b, p in budgets) + " |")
    print("|---|" + "---:|---:|" * len(budgets))
    shares = {b: [] for b in budgets}
    for aw, ah in ASPECTS:
        w, h = round((320 * 320 * aw / ah) ** 0.5), round((320 * 320 * ah / aw) ** 0.5)
        cells = []
        for budget, patch in budgets:
            rows, cols = native_grid(h, w, patch, budget)
            shares[(budget, patch)].append(rows * cols / budget)
            cells.append(f"{rows} x {cols} | {rows * cols / budget:.0%}")
        print(f"| {aw}:{ah} | " + " | ".join(cells) + " |")
    print("| mean | " + " | ".join(f" | {statistics.mean(s):.0%}" for s in shares.values()) + " |")


def cost(args: argparse.Namespace) -> None:
    keep_freed_memory()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    images = mixed_images(args.throughput_batch)
    patch = PRESETS[args.preset]().vision.patch_size
    side = 224 // patch
    print(f"{args.preset}, batch {args.throughput_batch} of aspect ratios 1:3 to 3:1 (about 320 x 320 pixels each), "
          f"{torch.get_num_threads()} threads, median of {args.throughput_steps} steps each; crop at 224 px "
          f"({side} x {side} patches of {patch}) against native within {side * side} patches; {load_average()}")
    print("| precision | crop samples/s | native samples/s | native / crop | native real patches "
          "| crop decode ms/image | native decode ms/image |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for precision in args.precisions.split(","):
        r = step_rates(args, precision, images)
        print(f"| {precision} | {r['crop']['sps']:.2f} | {r['native']['sps']:.2f} "
              f"| {r['native']['sps'] / r['crop']['sps']:.2f}x | {r['native']['real']:.1%} "
              f"| {r['crop']['decode_ms']:.1f} | {r['native']['decode_ms']:.1f} |", flush=True)
    print()
    print("Real patches among the positions a native step computes (each image padded to max_patches):")
    real_share_table(((49, 32), (256, 16)))


def load_average() -> str:
    return "load average %.1f / %.1f / %.1f" % os.getloadavg()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--rows", type=int, default=6000, help="training pairs of the edge set")
    ap.add_argument("--per-class", type=int, default=100, help="held-out images per shape kind")
    ap.add_argument("--short", type=int, default=48, help="short side of the edge set's images (long: 3x)")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of the benefit runs (the data stays the same)")
    ap.add_argument("--image-size", type=int, default=48, help="crop and squash side; native: max_patches its square")
    ap.add_argument("--preset", default="clip-vit-b32", help="the model of the throughput table")
    ap.add_argument("--throughput-batch", type=int, default=32)
    ap.add_argument("--throughput-steps", type=int, default=4)
    ap.add_argument("--precisions", default="", help="of the throughput table (default fp32, and bf16 if fast)")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--only", choices=("benefit", "cost"))
    ap.add_argument("--methods", default=",".join(METHODS), help="the resize methods of the benefit table")
    ap.add_argument("--keep", help="keep the data and runs here (default: a temporary folder)")
    args = ap.parse_args()
    fast_bf16 = cpu_has_bf16_matmul()
    args.train_precision = "bf16" if fast_bf16 else "fp32"
    args.precisions = args.precisions or ("fp32,bf16" if fast_bf16 else "fp32")
    work = Path(args.keep or tempfile.mkdtemp(prefix="native_shape."))
    try:
        if args.only != "cost":
            benefit(work, args)
            print()
        if args.only != "benefit":
            cost(args)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
