"""Images at their own shape: how much of a step is real patches, padded or packed, and what a
step of a SigLIP-style tower costs each way.

Images: aspect ratios log-uniform from 1:3 to 3:1, long side uniform from 64 to 1,024 px (seeded).
Each is resized to its grid within ``--max-patches`` (``vltrain.data.native.native_grid``), with
``upscale`` true (SigLIP 2: every image fills the budget as its aspect ratio allows) and false
(small images keep their size). Batches of ``--batch`` images are then either padded (one image
per sequence of max_patches) or packed (first fit, largest first, into sequences of max_patches:
``vltrain.data.loading.packing``). Printed: the share of patch positions that hold a real patch.

Then what a step holds, with ``upscale`` false: batches of ``--batch`` images (fixed batching)
against batches packed under a patch budget of ``--batch`` x the mean patches per image
(``data.patch_budget``: ``vltrain.data.schedule.budget.pack``, rows capped at twice ``--batch``):
patches and packed sequences per step, their spread, and rows per step.

Then the time of a forward and backward pass of a SigLIP-style tower (no class token, MAP head;
``--width``/``--depth``) on one batch, padded against packed, fp32 and, on a CPU with bf16 matrix
instructions (or a GPU), bf16 autocast: best of ``--repeats``.

Then packed images under patch dropout (``model.vision.patch_dropout`` f: an image of r patches
keeps r - floor(f r)), two ways to lay them out:

- *shortened*, what vltrain does (``vltrain.pixels.drop_packed``): the sequences are planned by
  full patch counts, then each keeps only its kept patches and is cut to K + (images per
  sequence) positions, K = N - floor(f N), a bound known from shapes alone;
- *planned by kept counts*: the sequences of N positions are planned by the kept counts, so more
  images fit each. Its tower cost is timed on the same tower given each image as its kept
  patches alone (a grid of 1 x k), packed by first fit into sequences of N: the blocks, the
  attention and the pooling it would run (the gather of the kept patches, small, left out).

Printed: positions and attention pairs (each sequence's length squared, what a block-diagonal
mask through one attention call costs) per image, the real share of the positions, and the timed
forward and backward of both with the image count of ``--timed-batch``.

    PYTHONPATH=src python benchmarks/native_packing.py [--max-patches 256] [--batch 64] [--images 1024]
        [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import random
import time

import numpy as np
import torch
from _demo_model import sync  # benchmarks/ is on sys.path

from vltrain.data.loading.packing import class_slots, layout
from vltrain.data.native import native_grid
from vltrain.data.schedule import budget as batching
from vltrain.data.table import SampleTable
from vltrain.model.vision import VisionConfig, VisionTransformer
from vltrain.pixels import kept_patches
from vltrain.runtime.precision import cpu_has_bf16_matmul
from vltrain.images import Images, real_patches

PATCH = 16


def image_sizes(count: int, seed: int = 0) -> list[tuple[int, int]]:
    """(height, width) of ``count`` images: aspect 1:3 to 3:1 (log-uniform), long side 64 to 1,024."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        aspect = math.exp(rng.uniform(math.log(1 / 3), math.log(3)))  # width / height
        long = rng.randint(64, 1024)
        w, h = (long, max(1, round(long / aspect))) if aspect >= 1 else (max(1, round(long * aspect)), long)
        out.append((h, w))
    return out


def grids_of(sizes: list[tuple[int, int]], budget: int, upscale: bool) -> list[tuple[int, int]]:
    return [native_grid(h, w, PATCH, budget, upscale=upscale) for h, w in sizes]


def shares(grids: list[tuple[int, int]], budget: int, batch: int) -> tuple[float, float, float]:
    """(padded share, packed share, sequences per image packed) over whole batches."""
    real = padded = packed = 0
    for start in range(0, len(grids) - batch + 1, batch):
        counts = [r * c for r, c in grids[start:start + batch]]
        _, segments, _ = layout(counts, budget)
        real += sum(counts)
        padded += batch * budget
        packed += segments.numel()
    return real / padded, real / packed, packed / budget / (padded / budget)


def step_spread(grids: list[tuple[int, int]], budget: int, batch: int) -> None:
    """Patches, packed sequences and rows per step: fixed batches against a patch budget."""
    counts = np.array([r * c for r, c in grids], dtype=np.int32)
    n = len(counts)
    table = SampleTable(np.ones(n, bool), np.ones(n, bool), np.full(n, 8, np.int32), np.zeros(n, np.int16),
                        patches=counts)
    patch_budget = int(round(batch * counts.mean()))
    order = np.random.default_rng(0).permutation(n)
    plans = {f"fixed, {batch} rows": [order[i:i + batch] for i in range(0, n - batch + 1, batch)]}
    packed = batching.pack(order, table, batch_size=2 * batch, token_budget=2 * batch * 8, image_budget=2 * batch,
                           rng=None, pad_multiple=1, patch_budget=patch_budget)
    plans[f"patch budget {patch_budget}"] = [b for b in packed if counts[b].sum() > patch_budget - budget]  # not a tail
    print(f"\nWhat a step holds (upscale false, {n} images)\n")
    print("| batching | steps | patches per step (min-max) | spread (std / mean) | packed sequences per step (min-max) "
          "| rows per step (min-max) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, steps in plans.items():
        patches = np.array([int(counts[b].sum()) for b in steps])
        sequences = [len(layout(counts[b].tolist(), budget)[1]) for b in steps]
        rows = [len(b) for b in steps]
        print(f"| {name} | {len(steps)} | {patches.min():,}-{patches.max():,} | {patches.std() / patches.mean():.1%} "
              f"| {min(sequences)}-{max(sequences)} | {min(rows)}-{max(rows)} |")


def batch_inputs(grids: list[tuple[int, int]], budget: int, pack: bool, seed: int = 0, device: str = "cpu") -> dict:
    """Random patches for these grids, padded or packed as the collator lays them out."""
    g = torch.Generator().manual_seed(seed)
    counts = [r * c for r, c in grids]
    dim = 3 * PATCH * PATCH
    grid_t = torch.tensor(grids)
    if not pack:
        x = torch.randn(len(grids), budget, dim, generator=g)
        x *= (torch.arange(budget) < torch.tensor(counts)[:, None])[..., None]
        return {k: v.to(device) for k, v in {"pixels": x, "grids": grid_t}.items()}
    places, segments, patch_index = layout(counts, budget)
    x = torch.zeros(segments.shape[0], budget, dim)
    for (seq, offset), n in zip(places, counts):
        x[seq, offset:offset + n] = torch.randn(n, dim, generator=g)
    out = {"pixels": x, "grids": grid_t, "segments": segments, "patch_index": patch_index,
           "slots": class_slots(places, counts, segments.shape[0])}
    return {k: v.to(device) for k, v in out.items()}


def step_time(tower: VisionTransformer, inputs: dict, dtype: torch.dtype | None, repeats: int) -> float:
    device = inputs["pixels"].device
    best = float("inf")
    for _ in range(repeats):
        tower.zero_grad(set_to_none=True)
        sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            _, pooled = tower(Images(**inputs))
        pooled.float().square().mean().backward()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def kept_count(r: int, fraction: float) -> int:
    return r - math.floor(fraction * r)


def dropout_layouts(grids: list[tuple[int, int]], budget: int, batch: int, fraction: float) -> dict[str, tuple]:
    """Per layout under patch dropout: (positions, attention pairs, real kept patches) over whole
    batches: shortened (planned by full counts, cut to K + images per sequence) and planned by kept
    counts (sequences of ``budget``), and padded (one row of K per image) for scale."""
    width = kept_count(budget, fraction)
    out = {"shortened": [0, 0, 0], "planned by kept counts": [0, 0, 0], "padded": [0, 0, 0]}
    for start in range(0, len(grids) - batch + 1, batch):
        counts = [r * c for r, c in grids[start:start + batch]]
        kept = [kept_count(n, fraction) for n in counts]
        places, segments, _ = layout(counts, budget)
        most = class_slots(places, counts, segments.shape[0]).shape[1]
        length = min(budget, width + most)
        sequences = len(layout(kept, budget)[1])
        for name, (rows, cols) in {"shortened": (segments.shape[0], length), "planned by kept counts":
                                   (sequences, budget), "padded": (batch, width)}.items():
            out[name][0] += rows * cols
            out[name][1] += rows * cols * cols
            out[name][2] += sum(kept)
    return {k: tuple(v) for k, v in out.items()}


def dropout_inputs(grids: list[tuple[int, int]], budget: int, fraction: float, device: str) -> dict[str, dict]:
    """The tower's inputs of one batch under patch dropout: shortened (the packed batch and each
    image's kept patches, a seeded draw) and planned by kept counts (each image as its kept patches,
    a grid of 1 x k, packed into sequences of ``budget``)."""
    shortened = batch_inputs(grids, budget, True, device=device)
    draw = torch.rand(len(grids), budget, generator=torch.Generator().manual_seed(1)).to(device)
    shortened["keep"] = kept_patches(draw, real_patches(shortened["grids"], budget), fraction)
    kept = [(1, kept_count(r * c, fraction)) for r, c in grids]
    return {"shortened": shortened, "planned by kept counts": batch_inputs(kept, budget, True, device=device)}


def dropout_tables(args: argparse.Namespace, sizes: list[tuple[int, int]], tower: VisionTransformer,
                   dtypes: list) -> None:
    budget = args.max_patches
    print(f"\nPacked images under patch dropout, batches of {args.batch} (positions and attention pairs per "
          f"image; real share: kept patches over positions)\n")
    print("| upscale | dropout | layout | positions per image | real share | attention pairs per image |")
    print("|---|---:|---|---:|---:|---:|")
    for upscale in (True, False):
        grids = grids_of(sizes, budget, upscale)
        for fraction in (0.5, 0.75):
            for name, (positions, pairs, real) in dropout_layouts(grids, budget, args.batch, fraction).items():
                images = len(grids) // args.batch * args.batch
                print(f"| {str(upscale).lower()} | {fraction:g} | {name} | {positions / images:.1f} "
                      f"| {real / positions:.1%} | {pairs / images:,.0f} |")
    print(f"\nForward + backward under patch dropout, {args.timed_batch} images, best of {args.repeats}\n")
    print("| upscale | precision | dropout | shortened (s) | planned by kept counts (s) | planned / shortened |")
    print("|---|---|---:|---:|---:|---:|")
    for upscale in (True, False):
        grids = grids_of(sizes[: args.timed_batch], budget, upscale)
        for name, dtype in dtypes:
            for fraction in (0.5, 0.75):
                inputs = dropout_inputs(grids, budget, fraction, args.device)
                times = {k: step_time(tower, v, dtype, args.repeats) for k, v in inputs.items()}
                short, planned = times["shortened"], times["planned by kept counts"]
                print(f"| {str(upscale).lower()} | {name} | {fraction:g} | {short:.3f} | {planned:.3f} "
                      f"| {planned / short:.2f}x |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-patches", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--images", type=int, default=1024)
    ap.add_argument("--width", type=int, default=384)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--timed-batch", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU")
    args = ap.parse_args()
    budget, sizes = args.max_patches, image_sizes(args.images)
    print(f"{args.images} images, aspect 1:3 to 3:1, long side 64-1024 px; patch {PATCH}, max_patches {budget}, "
          f"batches of {args.batch}; torch {torch.__version__}, {torch.get_num_threads()} threads; timed on "
          f"{torch.cuda.get_device_name(0) if args.device == 'cuda' else 'the CPU'}\n")
    print("| upscale | real patches per image (mean) | padded: real share | packed: real share | packed sequences / padded |")
    print("|---|---:|---:|---:|---:|")
    for upscale in (True, False):
        grids = grids_of(sizes, budget, upscale)
        padded, packed, ratio = shares(grids, budget, args.batch)
        mean = sum(r * c for r, c in grids) / len(grids)
        print(f"| {str(upscale).lower()} | {mean:.0f} | {padded:.1%} | {packed:.1%} | {ratio:.2f} |")
    step_spread(grids_of(sizes, budget, upscale=False), budget, args.batch)

    torch.manual_seed(0)
    tower = VisionTransformer(VisionConfig(image_size=budget and int(math.isqrt(budget)) * PATCH, patch_size=PATCH,
                                           width=args.width, depth=args.depth, heads=args.width // 64, pooling="map",
                                           class_token=False, pre_norm=False, patch_bias=True)).to(args.device)
    grids = grids_of(sizes[: args.timed_batch], budget, upscale=False)
    bf16 = args.device != "cpu" or cpu_has_bf16_matmul()
    dtypes = [("fp32", None)] + ([("bf16", torch.bfloat16)] if bf16 else [])
    print(f"\nForward + backward, {args.timed_batch} images (upscale false), tower {args.width} wide, {args.depth} "
          f"blocks, best of {args.repeats}\n")
    print("| precision | padded (s) | packed (s) | padded / packed |")
    print("|---|---:|---:|---:|")
    for name, dtype in dtypes:
        padded = step_time(tower, batch_inputs(grids, budget, False, device=args.device), dtype, args.repeats)
        packed = step_time(tower, batch_inputs(grids, budget, True, device=args.device), dtype, args.repeats)
        print(f"| {name} | {padded:.3f} | {packed:.3f} | {padded / packed:.2f}x |")
    dropout_tables(args, sizes, tower, dtypes)


if __name__ == "__main__":
    main()
